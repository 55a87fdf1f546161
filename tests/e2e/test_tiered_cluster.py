"""KV tiers through a real cluster: the router's prefetch hints, pulls served from a holder's
SSD tier, and a tensor-parallel decode worker whose prefixes go to host memory and back.

Workers get a device pool of `DEVICE_BLOCKS` blocks, so one `FILL_TOKENS` prompt takes all of
it and evicts every cached block into the (small) host tier, whose own evictions go to SSD.
Counters are read from the workers' `/metrics`, never through `GetStats` mid-test: each
`GetStats` answer carries (and so consumes) the KV events the router's index is fed with.
"""

from __future__ import annotations

import json
import time

import pytest

from pdserve.client import Client
from pdserve.engine import LLM, SamplingParams
from pdserve.proto import pb, worker_pb, worker_pb_grpc
from tests.e2e.test_metrics import scrape, total
from tests.helpers.checkpoints import VOCAB
from tests.helpers.cluster import eventually, start_cluster, wait_idle, worker_channel
from tests.helpers.engine import random_prompts

pytestmark = pytest.mark.timeout(240)
BLOCK = 16
DEVICE_BLOCKS = 8
FILL_TOKENS = DEVICE_BLOCKS * BLOCK - 8  # 8 blocks with its KV: the whole device pool
HOST_BLOCKS = 8  # 3 fills push a 4-block prefix through it to SSD
POLL_S = 2.5  # the router learns each worker's blocks from its next stats poll (every 1 s)
GIB = 2**30


def _block_bytes(model) -> int:
    """Bytes of one KV block of `model` in float32, all layers (what a tier slot holds)."""
    c = json.loads((model / "config.json").read_text())
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    return c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * BLOCK * head_dim * 4


def _tier_args(model, ssd_dir=None) -> tuple[str, ...]:
    host_gb = (HOST_BLOCKS + 0.5) * _block_bytes(model) / GIB  # half a block: no rounding loss
    args = ("--num-gpu-blocks", str(DEVICE_BLOCKS), "--block-size", str(BLOCK),
            "--kv-host-gb", f"{host_gb:.12f}")
    if ssd_dir is not None:
        args += ("--kv-ssd-dir", str(ssd_dir), "--kv-ssd-gb", "0.01")
    return args


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32")


def _expected(engine, prompts, max_tokens) -> list[list[int]]:
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in engine.generate(prompts, greedy)]


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory):
    # No prefill worker: decode workers prefill everything, so a prompt's blocks live only
    # where it ran. Round-robin: consecutive router requests go to different decode workers.
    tmp = tmp_path_factory.mktemp("tiered")
    c = start_cluster(tiny_llama, tmp, prefill=0, decode=2,
                      worker_args=_tier_args(tiny_llama, tmp / "ssd"),
                      router_args=("--routing", "round-robin"))
    yield c
    c.stop()


def _metrics(cluster) -> dict[str, dict]:
    return {c.info["address"]: scrape(c.info["metrics_address"]) for c in cluster.children}


def _moved(after, before, metric, **labels) -> dict[str, float]:
    return {a: total(after[a], metric, **labels) - total(before[a], metric, **labels)
            for a in after}


def _direct(address: str, rid: str, prompt: list[int], max_tokens: int) -> list[int]:
    """A Decode call straight to a decode worker that prefills locally (no router involved,
    so the router's round-robin turn does not move)."""
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    with worker_channel(address) as ch:
        events = list(worker_pb_grpc.WorkerStub(ch).Decode(worker_pb.DecodeRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=sampling, seed=1,
            local_prefill=True, deadline_unix_s=time.time() + 60), timeout=60))
    assert events[-1].WhichOneof("event") == "finished", rid
    return [t for ev in events if ev.WhichOneof("event") == "tokens"
            for t in ev.tokens.token_ids]


def _push_to_ssd(address: str, name: str, seed: int) -> None:
    """Run 3 prompts that each take a decode worker's whole device pool: the blocks it held
    go to host, then (host LRU, 8 slots) on to SSD."""
    for j, fill in enumerate(random_prompts([FILL_TOKENS] * 3, VOCAB, seed=seed)):
        _direct(address, f"{name}-fill-{j}", fill, 1)


def _wait_for_ssd(cluster, model) -> None:
    """Until every SSD write the workers issued has landed (they land in the background; the
    SSD tier is far too big to drop any), then until the router polled them."""
    block_bytes = _block_bytes(model)

    def landed() -> bool:
        return all(total(m, "pdserve_kv_tier_blocks", tier="ssd", state="used") * block_bytes
                   == total(m, "pdserve_kv_tier_bytes_total", tier="ssd", direction="in")
                   for m in _metrics(cluster).values())

    eventually(landed, "SSD writes")
    time.sleep(POLL_S)


def test_second_turn_of_a_prefix_pushed_to_ssd_sends_a_prefetch_hint(cluster, engine,
                                                                      tiny_llama):
    workers = [c.info["address"] for c in cluster.workers("decode")]
    turn1 = random_prompts([64], VOCAB, seed=71)[0]  # 4 full blocks
    # Both decode workers hold turn 1 on SSD only: wherever round-robin sends turn 2, its
    # worker's match runs into SSD and no other worker holds more (no pull).
    for i, address in enumerate(workers):
        out1 = _direct(address, f"ssd-turn1-{i}", turn1, 4)
        _push_to_ssd(address, f"ssd-{i}", seed=72)
    _wait_for_ssd(cluster, tiny_llama)
    before, router_before = _metrics(cluster), scrape(cluster.http_address)
    turn2 = turn1 + out1 + random_prompts([10], VOCAB, seed=73)[0]
    with Client(cluster.address, max_retries=0) as client:
        out2 = client.generate(turn2, max_tokens=6, temperature=0.0, ignore_eos=True)
    after, router = _metrics(cluster), scrape(cluster.http_address)

    ran = _moved(after, before, "pdserve_decode_admissions_total", prefill="local")
    chosen = next(a for a, n in ran.items() if n == 1)
    assert sorted(ran.values()) == [0, 1]
    for name in ("prefetch_hints", "prefetch_hint_failures", "kv_pulls_routed"):
        metric = f"pdserve_router_{name}_total"
        assert total(router, metric) - total(router_before, metric) == (
            name == "prefetch_hints"), name
    # The 4 SSD blocks were read into host in the background, started by the hint or by the
    # request's own staging, whichever reached the engine thread first; the request then
    # loaded them from host.
    started = _moved(after, before, "pdserve_kv_tier_prefetches_total", stage="started")
    staged = _moved(after, before, "pdserve_kv_tier_staged_blocks_total")
    assert started[chosen] + staged[chosen] == 4
    assert _moved(after, before, "pdserve_kv_tier_prefetches_total", stage="done")[chosen] == 4
    assert _moved(after, before, "pdserve_kv_tier_hits_total", tier="host")[chosen] == 4
    assert out2.usage.cached_tokens == 64
    assert [out1, out2.token_ids] == [_expected(engine, [turn1], 4)[0],
                                      _expected(engine, [turn2], 6)[0]]
    assert not any(wait_idle(cluster).values())


def test_pull_from_a_holder_whose_prefix_is_on_ssd(cluster, engine, tiny_llama):
    turn1 = random_prompts([64], VOCAB, seed=81)[0]
    with Client(cluster.address, max_retries=0) as client:
        before1 = _metrics(cluster)
        out1 = client.generate(turn1, max_tokens=4, temperature=0.0, ignore_eos=True)
        ran = _moved(_metrics(cluster), before1, "pdserve_decode_admissions_total")
        holder = next(a for a, n in ran.items() if n == 1)
        _push_to_ssd(holder, "pull", seed=82)
        _wait_for_ssd(cluster, tiny_llama)
        before, router_before = _metrics(cluster), scrape(cluster.http_address)
        turn2 = turn1 + out1.token_ids + random_prompts([12], VOCAB, seed=83)[0]
        out2 = client.generate(turn2, max_tokens=6, temperature=0.0, ignore_eos=True)
    after, router = _metrics(cluster), scrape(cluster.http_address)

    puller = next(a for a in after if a != holder)  # round-robin: the other decode worker
    assert _moved(after, before, "pdserve_decode_admissions_total")[puller] == 1
    assert _moved(after, before, "pdserve_kv_pulled_blocks_total") == {puller: 4, holder: 0}
    assert _moved(after, before, "pdserve_kv_pull_failures_total")[puller] == 0
    assert _moved(after, before, "pdserve_kv_pushed_blocks_total") == {puller: 0, holder: 4}
    # The router hinted the holder too: its SSD blocks started up to host at once (the push
    # reads SSD directly, never through host, so the hint finds them there in any order).
    started = _moved(after, before, "pdserve_kv_tier_prefetches_total", stage="started")
    assert started == {puller: 0, holder: 4}
    # The holder loaded them into device blocks to push them: from host where the prefetch
    # got there first, else from SSD.
    assert _moved(after, before, "pdserve_kv_tier_hits_total")[holder] == 4
    for name in ("prefetch_hints", "kv_pulls_routed"):
        metric = f"pdserve_router_{name}_total"
        assert total(router, metric) - total(router_before, metric) == 1, name
    assert out2.usage.cached_tokens == 64
    assert [out1.token_ids, out2.token_ids] == [
        _expected(engine, [turn1], 4)[0], _expected(engine, [turn2], 6)[0]]
    assert not any(wait_idle(cluster).values())


def test_tp2_decode_worker_takes_prefixes_back_from_host(tiny_llama, tmp_path, engine):
    cluster = start_cluster(tiny_llama, tmp_path, prefill=1, decode=1, decode_tp=2,
                            worker_args=_tier_args(tiny_llama))
    try:
        (d,) = [c.info["metrics_address"] for c in cluster.workers("decode")]
        turn1 = random_prompts([64, 64], VOCAB, seed=91)  # prefilled by P, KV to both ranks
        fill = random_prompts([FILL_TOKENS], VOCAB, seed=92)[0]
        extra = random_prompts([14, 14], VOCAB, seed=93)
        with Client(cluster.address, max_retries=0) as client:
            out1 = [client.generate(p, max_tokens=4, temperature=0.0, ignore_eos=True)
                    for p in turn1]
            # Takes every device block of D: both conversations' prefixes go to host.
            out_fill = client.generate(fill, max_tokens=1, temperature=0.0, ignore_eos=True)
            time.sleep(POLL_S)
            before = scrape(d)
            turn2 = [p + o.token_ids + e for p, o, e in zip(turn1, out1, extra, strict=True)]
            out2 = [client.generate(p, max_tokens=6, temperature=0.0, ignore_eos=True)
                    for p in turn2]
        after = scrape(d)
        assert [o.token_ids for o in out1] == _expected(engine, turn1, 4)
        assert out_fill.token_ids == _expected(engine, [fill], 1)[0]
        assert [o.token_ids for o in out2] == _expected(engine, turn2, 6)
        # D computes only the new tail itself: its prefix comes back from host memory (the
        # first load always, later ones while loading beats recomputing).
        hits = (total(after, "pdserve_kv_tier_hits_total", tier="host")
                - total(before, "pdserve_kv_tier_hits_total", tier="host"))
        assert hits >= 4
        assert out2[0].usage.cached_tokens == 64
        cut = [v for (n, _), v in after.items() if n == "pdserve_kv_tier_load_cut_by_peer_total"]
        assert cut == [0]  # every rank had every block rank 0 chose to load
        assert not any(wait_idle(cluster).values())
    finally:
        cluster.stop()
