"""The scheduler's waiting-for-KV states (remote prefill and pull), without a model: what is
reserved, what an activation or a settled pull leaves, and that every block comes back."""

from __future__ import annotations

import pytest

from kv_store.block_pool import BlockPool
from pdserve.block_hash import chain_hashes
from pdserve.engine.finish import FinishReason
from pdserve.engine.kv_manager import KVCacheManager
from pdserve.engine.remote_kv import KVArrival, KVOutOfBounds
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler, SchedulerConfig

BS, EXTRA = 4, b"x" * 16
PROMPT = list(range(10, 31))  # 21 tokens: 5 full blocks, one token past them


def make(num_blocks=16, cached=0) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks, BS), EXTRA)
    if cached:  # the prefix cache holds the first `cached` blocks of PROMPT
        held = kv.pool.allocate(cached)
        for i, (b, h) in enumerate(zip(held, chain_hashes(PROMPT, BS, EXTRA), strict=False)):
            kv.pool.cache_block(b, h, PROMPT[i * BS:(i + 1) * BS])
        kv.pool.free(list(reversed(held)))
    return Scheduler(SchedulerConfig(max_num_batched_tokens=64), kv)


def req(rid="r", prompt=PROMPT, generated=(), max_tokens=10) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens), seed=0,
                   output_token_ids=list(generated))


def step(s: Scheduler, token=7):
    plan = s.schedule()
    s.update(plan, {c.request_id: [token] for c in plan.chunks if c.num_samples})
    return plan


def test_remote_reservation_takes_the_prefix_hit_and_holds_the_whole_prompt():
    s = make(cached=2)
    res = s.reserve_remote(req())
    assert res.cached_blocks == 2 and len(res.block_ids) == 6  # ceil(21 / 4)
    assert res.needed == res.block_ids[2:]
    r = s.requests["r"]
    assert r.status is RequestStatus.WAITING_FOR_KV and r.num_cached_tokens == 8
    assert s.num_waiting_for_kv == 1 and not s.has_work  # nothing to step until the KV lands
    assert s.schedule().is_empty


def test_activation_runs_the_request_with_the_first_token_and_publishes_the_prompt():
    s = make()
    res = s.reserve_remote(req())
    assert s.activate("r", 42, None).status is RequestStatus.RUNNING
    r = s.requests["r"]
    assert r.output_token_ids == [42] and r.num_computed_tokens == len(PROMPT)
    plan = step(s)  # a decode step on the first token, at the end of the prompt
    assert plan.chunks[0].token_ids == [42] and plan.chunks[0].start == len(PROMPT)
    assert s.kv.pool.num_cached == 5 and list(res.block_ids) == r.block_ids[:6]
    s.finish("r", RequestStatus.FINISHED_STOPPED)
    assert s.kv.pool.is_idle()


def test_a_first_token_that_stops_the_request_ends_it_at_activation():
    s = make()
    s.reserve_remote(req())
    r = s.activate("r", 2, FinishReason.STOP)
    assert r.status is RequestStatus.FINISHED_STOPPED and "r" not in s.requests
    assert s.kv.pool.is_idle() and s.kv.pool.num_cached == 5  # its prompt stays findable


def test_a_failed_or_cancelled_reservation_frees_everything_and_activates_nothing():
    s = make(cached=1)
    s.reserve_remote(req())
    assert s.finish("r", RequestStatus.FINISHED_ABORTED) is not None
    assert s.activate("r", 1, None) is None  # the late arrival of the KV finds nothing
    assert s.kv.pool.is_idle() and not s.requests


def test_no_room_reserves_nothing_and_leaves_no_trace():
    s = make(num_blocks=4)
    assert s.reserve_remote(req()) is None
    assert not s.requests and s.kv.pool.is_idle()


def test_a_pull_pins_our_prefix_and_reserves_up_to_what_the_source_holds():
    s = make(cached=2)
    res = s.reserve_pull(req(), source_blocks=9)
    assert (res.start_block, res.end_block) == (2, 5)  # block 5 is not full
    assert s.requests["r"].status is RequestStatus.PULLING and s.num_waiting_for_kv == 1
    assert s.kv.pool.num_used == 5 and not s.has_work


def test_a_settled_pull_publishes_what_landed_and_the_prefill_starts_after_it():
    s = make(cached=1)
    s.reserve_pull(req(), source_blocks=4)  # blocks 1..3 to pull
    assert s.settle_pull("r", 2) == 2  # blocks 1 and 2 landed, block 3 did not
    assert s.requests["r"].status is RequestStatus.WAITING and s.kv.pool.num_used == 3
    plan = step(s)
    assert plan.chunks[0].start == 3 * BS  # the prefix hit covers own + landed blocks
    assert s.requests["r"].num_cached_tokens == 3 * BS
    s.finish("r", RequestStatus.FINISHED_STOPPED)
    assert s.kv.pool.is_idle()


def test_nothing_to_pull_queues_the_request_at_once():
    s = make(cached=3)
    assert s.reserve_pull(req(), source_blocks=3) is None
    assert s.requests["r"].status is RequestStatus.WAITING and s.kv.pool.is_idle()


def test_a_pull_cancelled_midway_releases_every_block_and_a_late_settle_is_harmless():
    s = make(cached=2)
    s.reserve_pull(req(), source_blocks=5)
    s.finish("r", RequestStatus.FINISHED_ABORTED)
    assert s.settle_pull("r", 3) == 0
    assert s.kv.pool.is_idle() and not s.pulls


def test_a_continuation_pulls_and_computes_its_earlier_output_as_output():
    s = make(cached=5)  # the whole prompt prefix is here already
    r = req(generated=[50, 51, 52])  # 24 tokens: 5 full blocks usable
    assert s.reserve_pull(r, source_blocks=5) is None
    plan = s.schedule()
    c = plan.chunks[0]
    assert c.start == 5 * BS and c.token_ids == PROMPT[20:] + [50, 51, 52]
    assert c.num_samples == 1  # the next token is output token #3, sampled with step 3


def test_arrival_tracks_parts_and_refuses_what_was_not_reserved():
    arrival = KVArrival([5, 2, 7], skip=1, num_layers=2, heads=range(0, 2))
    assert arrival.num_missing == 2 * 2 * 2
    with pytest.raises(KVOutOfBounds):
        arrival.check(0, [5], 0, 2)  # block 5 was already held: never sent
    with pytest.raises(KVOutOfBounds):
        arrival.check(0, [2], 1, 2)  # head 2 belongs to another rank
    with pytest.raises(KVOutOfBounds):
        arrival.check(2, [2], 0, 2)
    for layer in range(2):
        arrival.check(layer, [2], 0, 2)
        arrival.record(layer, [2], 0, 2)
    assert not arrival.complete
    arrival.limit(1)  # the source only had block 2
    assert arrival.complete


def test_the_pushing_side_pins_a_run_from_a_later_block_checking_hashes_and_tokens():
    s = make(cached=4)
    kv = s.kv
    run = kv.pin_leading(PROMPT, 2, 5)
    assert len(run) == 2 and kv.pool.num_used == 2  # blocks 2, 3 (block 4 is not held)
    kv.unpin(run)
    other = PROMPT[:8] + [0] * 13  # same first two blocks, different block 2
    assert kv.pin_leading(other, 2, 5) == []
    assert kv.pool.is_idle()
