"""The scheduler is pure Python: these tests run it with no model and no tensors."""

from __future__ import annotations

from kv_store.block_pool import BlockPool
from pdserve.engine.kv_manager import KVCacheManager
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler, SchedulerConfig

BS = 4


def make(num_blocks=64, budget=16, max_seqs=8, caching=True) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks, BS, caching), b"")
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs), kv)


def req(rid: str, n: int, first: int = 100) -> Request:
    return Request(rid, list(range(first, first + n)), SamplingParams(max_tokens=100), seed=0)


def run_step(s: Scheduler, token: int = 7):
    plan = s.schedule()
    sampled = {c.request_id: [token] for c in plan.chunks if c.num_samples}
    s.update(plan, sampled)
    return plan


def test_chunked_prefill_respects_budget_and_samples_only_at_the_end():
    s = make(budget=8)
    s.add(req("a", 20))
    sizes, samples = [], []
    for _ in range(3):
        plan = run_step(s)
        sizes.append(len(plan.chunks[0].token_ids))
        samples.append(plan.chunks[0].num_samples)
    assert sizes == [8, 8, 4] and samples == [0, 0, 1]
    assert s.requests["a"].output_token_ids == [7]
    plan = run_step(s)  # decode: one token, the last sampled one
    assert plan.chunks[0].token_ids == [7] and plan.chunks[0].start == 20


def test_running_decodes_go_before_new_prefills_fcfs():
    s = make(budget=10)
    s.add(req("a", 4))
    run_step(s)
    s.add(req("b", 30))
    s.add(req("c", 3))
    plan = s.schedule()
    assert [c.request_id for c in plan.chunks] == ["a", "b"]  # c waits behind b (no overtaking)
    assert [len(c.token_ids) for c in plan.chunks] == [1, 9]


def test_max_num_seqs_caps_the_running_batch():
    s = make(budget=100, max_seqs=2)
    for r in "abc":
        s.add(req(r, 4))
    plan = s.schedule()
    assert [c.request_id for c in plan.chunks] == ["a", "b"]


def test_preemption_frees_the_latest_request_and_requeues_it_first():
    s = make(num_blocks=4, budget=64)
    s.add(req("a", 8))
    s.add(req("b", 8))
    run_step(s)  # a: 2 blocks, b: 2 blocks: pool full
    plan = run_step(s)  # a needs a third block for position 8 -> b is preempted
    assert plan.preempted == ["b"]
    assert s.waiting[0].request_id == "b" and s.requests["b"].num_computed_tokens == 0
    assert s.requests["b"].status is RequestStatus.WAITING
    assert s.requests["b"].output_token_ids == [7]  # kept, recomputed on readmission


def test_prefix_hit_skips_cached_blocks_but_leaves_one_token():
    s = make()
    s.add(req("a", 12))
    run_step(s)
    s.finish("a", RequestStatus.FINISHED_STOPPED)
    s.add(req("b", 12))  # identical prompt: blocks 0..1 reusable, the last must be recomputed
    plan = s.schedule()
    assert plan.chunks[0].start == 8 and len(plan.chunks[0].token_ids) == 4
    assert s.requests["b"].num_cached_tokens == 8


def test_finish_releases_blocks_and_is_idempotent():
    s = make()
    s.add(req("a", 9))
    run_step(s)
    assert s.finish("a", RequestStatus.FINISHED_ABORTED) is not None
    assert s.finish("a", RequestStatus.FINISHED_ABORTED) is None
    assert s.kv.pool.is_idle() and not s.has_work


def test_speculative_tokens_are_scheduled_with_the_decode_token():
    s = make()
    s.add(req("a", 4))
    run_step(s)
    s.requests["a"].spec_token_ids = [1, 2, 3]
    plan = s.schedule()
    c = plan.chunks[0]
    assert c.token_ids == [7, 1, 2, 3] and c.num_samples == 4
    s.update(plan, {"a": [1, 9]})  # one draft accepted, then a correction
    r = s.requests["a"]
    assert r.output_token_ids == [7, 1, 9] and r.num_computed_tokens == 6
