"""The engine with host / SSD KV tiers: greedy output unchanged, evicted blocks come back."""

from __future__ import annotations

import pytest

from kv_store.index.events import Tier
from kv_store.index.recorder import BlockRecorder
from pdserve.engine import LLM
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from tests.helpers.engine import assert_idle, random_prompts

GREEDY = SamplingParams(max_tokens=4, temperature=0)
BS = 4
BASE = dict(dtype="float32", block_size=BS, max_num_batched_tokens=64)


class FixedSpeeds:
    """Stands in for the measured speeds, so the load-or-recompute choice is deterministic."""

    def __init__(self, host_bw: float, ssd_bw: float, prefill_tps: float) -> None:
        self._bw = {Tier.HOST: host_bw, Tier.SSD: ssd_bw}
        self.prefill_tps = prefill_tps

    def bandwidth(self):
        return dict(self._bw)

    def record_read(self, *args) -> None:
        pass

    def record_prefill(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def setup(tiny_llama):
    llm = LLM(str(tiny_llama), **BASE, num_gpu_blocks=64)
    block_bytes = sum(c[0].numel() * c.element_size() for c in llm.engine.runner.caches)
    prompts = random_prompts([22, 23, 21], llm.engine.vocab_size, seed=7)
    ref = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
    return tiny_llama, block_bytes, prompts, ref


def _tiered(setup, tmp_path, host_blocks: int, ssd_blocks: int, speeds=None):
    path, block_bytes, _, _ = setup
    opts = dict(BASE, num_gpu_blocks=10)
    if host_blocks:
        opts["kv_host_gb"] = host_blocks * block_bytes / 2**30
    if ssd_blocks:
        opts["kv_ssd_dir"] = str(tmp_path / "ssd")
        opts["kv_ssd_gb"] = ssd_blocks * (block_bytes + 4 * BS + 64) / 2**30
    llm = LLM(str(path), **opts)
    rec = BlockRecorder("w0")
    if llm.engine.tiers is not None:
        llm.engine.tiers._on_event = rec.on_block_event
        llm.engine.tiers.bandwidth = speeds or FixedSpeeds(1e12, 1e12, 1.0)
    return llm, rec


def _run_all_then_first_again(llm, setup) -> list[list[int]]:
    _, _, prompts, _ = setup
    outs = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
    if llm.engine.tiers is not None:
        llm.engine.tiers.flush()
    outs.append(llm.generate([prompts[0]], GREEDY)[0].token_ids)
    return outs


@pytest.mark.parametrize("host_blocks,ssd_blocks", [(0, 0), (64, 0), (3, 64), (0, 64)],
                         ids=["device", "host", "host+ssd", "ssd"])
def test_greedy_output_unchanged_with_every_tier_combination(setup, tmp_path, host_blocks,
                                                             ssd_blocks):
    llm, rec = _tiered(setup, tmp_path, host_blocks, ssd_blocks)
    outs = _run_all_then_first_again(llm, setup)
    ref = setup[3]
    assert outs == ref + [ref[0]]
    assert_idle(llm)
    stats = llm.engine.stats()
    if host_blocks >= 64:
        assert stats["kv_tier_host_hits"] >= 5  # the whole 5-block prefix came from host
    if ssd_blocks:  # blocks came back from SSD: read at load, or staged into host first
        assert stats.get("kv_tier_ssd_hits", 0) + stats.get("kv_tier_prefetched", 0) >= 1
    tiers = llm.engine.tiers
    if tiers is not None:
        snap = rec.snapshot()
        if tiers.host is not None:
            assert set(snap.get(Tier.HOST, [])) == set(tiers.host.hashes())
            assert len(tiers.host) <= tiers.host.num_slots
        if tiers.ssd is not None:
            assert len(snap.get(Tier.SSD, [])) == len(tiers.ssd)
    llm.engine.close()


def test_corrupted_ssd_block_is_recomputed_not_served(setup, tmp_path):
    _, _, prompts, ref = setup
    llm, _ = _tiered(setup, tmp_path, 0, 64)
    for p in prompts:
        llm.generate([p], GREEDY)
    tiers = llm.engine.tiers
    tiers.flush()
    ssd = tiers.ssd
    corrupted = 0
    for seg in sorted(ssd.dir.glob("seg-*.pdkv")):
        raw = bytearray(seg.read_bytes())
        for off in range(0, len(raw), ssd.record_bytes):
            raw[off + ssd.record_bytes - 3] ^= 0xFF  # last data byte of every record
            corrupted += 1
        seg.write_bytes(bytes(raw))
    assert corrupted > 0
    out = llm.generate([prompts[0]], GREEDY)[0].token_ids
    assert out == ref[0]
    assert llm.engine.stats()["kv_tier_ssd_corrupted"] >= 1
    assert_idle(llm)
    llm.engine.close()


def test_slow_tier_is_recomputed_instead_of_loaded(setup, tmp_path):
    _, _, prompts, ref = setup
    slow = FixedSpeeds(host_bw=1e12, ssd_bw=1.0, prefill_tps=1e6)
    llm, _ = _tiered(setup, tmp_path, 0, 64, speeds=slow)
    outs = _run_all_then_first_again(llm, setup)
    assert outs == ref + [ref[0]]
    stats = llm.engine.stats()
    assert stats.get("kv_tier_ssd_hits", 0) == 0
    assert stats["kv_tier_blocks_recompute_chosen"] >= 1
    assert_idle(llm)
    llm.engine.close()


def test_tier_options_are_validated(tiny_llama):
    # Tiers and tensor parallelism combine (tests/engine/test_tiered_tp.py runs them).
    EngineConfig(model=str(tiny_llama), kv_host_gb=1.0, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="kv_ssd_dir"):
        EngineConfig(model=str(tiny_llama), kv_ssd_gb=1.0)
    with pytest.raises(ValueError, match="kv_demote_ahead_blocks"):
        EngineConfig(model=str(tiny_llama), kv_host_gb=1.0, kv_demote_ahead_blocks=-1)
    assert LLMEngine  # the engine module imports with tiers wired in


def test_demotion_ahead_copies_next_evictions_once_and_eviction_copies_nothing(setup, tmp_path):
    _, _, prompts, ref = setup
    llm, _ = _tiered(setup, tmp_path, 64, 0)  # 64 host slots: an ahead window of 16 blocks
    host_events: list[tuple[str, bytes]] = []
    llm.engine.tiers._on_event = lambda ev, tier: (
        host_events.append((ev.kind, ev.block_hash)) if tier is Tier.HOST else None)
    engine, pool, tiers = llm.engine, llm.engine.pool, llm.engine.tiers
    assert llm.generate([prompts[0]], GREEDY)[0].token_ids == ref[0]
    while engine.idle_tick():  # idle ticks until nothing is left to copy
        pass
    ahead = pool.eviction_candidates(16)
    n = len(ahead)
    assert n == 6  # 22 prompt + 3 computed output tokens: 6 full blocks, all cached-free
    for b in ahead:  # in host, and still on the device
        assert tiers.host.has(b.block_hash, b.token_ids)
        assert pool.lookup(b.block_hash, b.token_ids) == b.block_id
    stats = engine.stats()
    assert stats["kv_tier_demoted_ahead"] == n
    assert stats.get("kv_tier_demote_copies", 0) == 0
    copied_before = stats["kv_tier_host_bytes_in"]

    outs = [llm.generate([p], GREEDY)[0].token_ids for p in prompts[1:]]  # evicts prompt 0
    assert outs == ref[1:]
    assert all(pool.lookup(b.block_hash, b.token_ids) is None for b in ahead)
    stats = engine.stats()
    assert stats["kv_tier_demote_found_in_host"] >= n  # their eviction copied nothing
    new_copies = stats.get("kv_tier_demote_copies", 0) + stats["kv_tier_demoted_ahead"] - n
    assert stats["kv_tier_host_bytes_in"] - copied_before == new_copies * tiers.block_bytes
    for b in ahead:  # one HOST "stored" event per block, none at its eviction
        assert host_events.count(("stored", b.block_hash)) == 1
    assert llm.generate([prompts[0]], GREEDY)[0].token_ids == ref[0]
    assert engine.stats()["kv_tier_host_hits"] >= 5
    assert_idle(llm)
    llm.engine.close()


def test_prefetch_promotes_ssd_blocks_into_host(setup, tmp_path):
    import time

    llm, rec = _tiered(setup, tmp_path, 3, 64)
    _run_all_then_first_again(llm, setup)
    tiers = llm.engine.tiers
    tiers.flush()
    cold = [h for h in rec.snapshot().get(Tier.SSD, []) if h not in tiers.host][:2]
    assert cold
    assert tiers.prefetch(cold + [b"\x00" * 16]) == len(cold)  # unknown hash: skipped
    deadline = time.monotonic() + 10
    while tiers.pending(frozenset(cold)) and time.monotonic() < deadline:
        time.sleep(0.01)  # reads land on I/O threads; `pending` moves them into host
    assert all(h in tiers.host for h in cold)
    assert set(rec.snapshot()[Tier.HOST]) == set(tiers.host.hashes())
    llm.engine.close()


def test_request_waits_only_for_its_own_ssd_reads(setup, tmp_path):
    """A request whose prefix is on SSD is staged (SSD → host in the background) and keeps
    its place while a request behind it runs; once its reads land it is admitted and its
    blocks come from host memory. Output unchanged."""
    import threading
    from concurrent.futures import Future

    _, _, prompts, ref = setup
    llm, _ = _tiered(setup, tmp_path, 3, 64)
    _run_all_then_first_again(llm, setup)  # prompt 1's blocks end up on SSD only
    engine, tiers = llm.engine, llm.engine.tiers
    tiers.flush()
    gate = threading.Event()
    real_read = tiers.ssd.read_many

    def gated_read(blocks):  # SSD reads complete only when the test opens the gate
        outs = [Future() for _ in blocks]
        inner = real_read(blocks)

        def release():
            gate.wait(10)
            for o, i in zip(outs, inner, strict=True):
                o.set_result(i.result())
        threading.Thread(target=release, daemon=True).start()
        return outs

    tiers.ssd.read_many = gated_read
    fresh = random_prompts([9], engine.vocab_size, seed=99)[0]
    engine.add_request("ssd", prompts[1], GREEDY)
    engine.add_request("fresh", fresh, GREEDY)
    outs: dict[str, list[int]] = {}
    for out in engine.step():
        outs.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert [r.request_id for r in engine.scheduler.running] == ["fresh"]
    assert [r.request_id for r in engine.scheduler.waiting] == ["ssd"]
    assert engine.stats()["kv_tier_staged_blocks"] >= 1
    gate.set()
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert outs["ssd"] == ref[1]
    assert outs["fresh"] == llm.generate([fresh], GREEDY)[0].token_ids
    assert engine.stats()["kv_tier_prefetched"] >= 1  # its staged reads landed in host
    assert_idle(llm)
    llm.engine.close()


def test_persisted_ssd_tier_serves_a_restarted_engine(setup, tmp_path):
    """With kv_ssd_persist, an engine started on the same directory finds the blocks the
    previous one left on SSD and computes only what is new; output unchanged."""
    path, block_bytes, prompts, ref = setup
    opts = dict(BASE, num_gpu_blocks=10, kv_ssd_dir=str(tmp_path / "ssd"),
                kv_ssd_gb=64 * (block_bytes + 4 * BS + 64) / 2**30, kv_ssd_persist=True)
    first = LLM(str(path), **opts)
    for p in prompts:
        first.generate([p], GREEDY)
    first.engine.tiers.flush()
    first.engine.close()

    again = LLM(str(path), **opts)
    again.engine.tiers.bandwidth = FixedSpeeds(1e12, 1e12, 1.0)
    assert again.engine.stats()["kv_tier_ssd_blocks"] >= 5
    out = again.generate([prompts[0]], GREEDY)[0]
    assert out.token_ids == ref[0]
    assert out.num_cached_tokens >= 5 * BS  # the 5-block prefix came back from SSD
    assert_idle(again)
    again.engine.close()
