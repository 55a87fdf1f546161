"""DeepSeek-V3 (MLA + MoE) through the disaggregated cluster: a TP=2 prefill worker streams
the latent to TP=1 decode workers once (never per head), and a decode worker pulls a latent
prefix another one holds on SSD; every output equals the single-process engine's and every
block pool returns to idle."""

from __future__ import annotations

import pytest

from pdserve.client import Client
from pdserve.engine import LLM, SamplingParams
from tests.e2e.test_metrics import total
from tests.e2e.test_tiered_cluster import _direct, _metrics, _moved
from tests.helpers.checkpoints import VOCAB
from tests.helpers.cluster import (
    eventually,
    start_cluster,
    wait_idle,
    wait_polled,
    worker_stats,
)
from tests.helpers.engine import random_prompts

pytestmark = pytest.mark.timeout(300)
BLOCK = 16
DEVICE_BLOCKS = 8
FILL_TOKENS = DEVICE_BLOCKS * BLOCK - 8  # takes every device block of the decode worker


def _greedy(llm: LLM, prompts, max_tokens: int) -> list[list[int]]:
    p = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, p)]


@pytest.fixture(scope="module")
def engine(tiny_deepseek_v3):
    return LLM(str(tiny_deepseek_v3), dtype="float32")


@pytest.fixture(scope="module")
def cluster(tiny_deepseek_v3, tmp_path_factory, engine):
    tmp = tmp_path_factory.mktemp("mla-cluster")
    ssd_gb = 256 * engine.engine.kv_layout.block_bytes() / 2**30
    # Round-robin: consecutive router requests go to different decode workers, so a second
    # turn lands where its prefix is not and pulls it.
    c = start_cluster(tiny_deepseek_v3, tmp, prefill=1, decode=2, prefill_tp=2,
                      worker_args=("--num-gpu-blocks", str(DEVICE_BLOCKS), "--block-size",
                                   str(BLOCK), "--kv-ssd-dir", str(tmp / "ssd"),
                                   "--kv-ssd-gb", f"{ssd_gb:.12f}"),
                      router_args=("--routing", "round-robin"))
    yield c
    c.stop()


def test_p_tp2_sends_the_latent_once_to_d_tp1(cluster, engine):
    prompts = random_prompts([40, 75, 100], VOCAB, seed=43)
    p_addr = cluster.workers("prefill")[0].info["address"]
    before = worker_stats(p_addr).counters
    with Client(cluster.address) as client:
        got = [client.generate(p, max_tokens=8, temperature=0.0, ignore_eos=True,
                               timeout=60).token_ids for p in prompts]
    assert got == _greedy(engine, prompts, 8)
    layout = engine.engine.kv_layout

    def sent() -> float:
        return worker_stats(p_addr).counters["kv_bytes"] - before.get("kv_bytes", 0.0)

    # Prefill rank 0 alone sends (rank 1 holds the same latent): exactly one copy per token.
    want = sum(layout.transfer_bytes(len(p)) for p in prompts)
    eventually(lambda: sent() == want, f"{want} KV bytes sent")
    assert not any(wait_idle(cluster).values())


def test_a_latent_prefix_on_ssd_is_pulled_by_another_decode_worker(cluster, engine):
    turn1 = random_prompts([64], VOCAB, seed=91)[0]  # 4 full blocks
    with Client(cluster.address, max_retries=0) as client:
        before1 = _metrics(cluster)
        out1 = client.generate(turn1, max_tokens=4, temperature=0.0, ignore_eos=True)
        ran = _moved(_metrics(cluster), before1, "pdserve_decode_admissions_total")
        holder = next(a for a, n in ran.items() if n == 1)
        for j, fill in enumerate(random_prompts([FILL_TOKENS] * 2, VOCAB, seed=92)):
            _direct(holder, f"mla-fill-{j}", fill, 1)  # turn 1's blocks: device -> SSD

        def on_ssd() -> bool:
            m = _metrics(cluster)[holder]
            return total(m, "pdserve_kv_tier_blocks", tier="ssd", state="used") >= 4

        eventually(on_ssd, "turn 1's latent blocks on SSD")
        wait_polled(cluster)  # the router learns the workers' blocks from its next poll
        before = _metrics(cluster)
        turn2 = turn1 + out1.token_ids + random_prompts([12], VOCAB, seed=93)[0]
        out2 = client.generate(turn2, max_tokens=6, temperature=0.0, ignore_eos=True)
    after = _metrics(cluster)
    puller = next(a for a in after if a not in (holder, _prefill(cluster)))
    assert _moved(after, before, "pdserve_kv_pulled_blocks_total")[puller] == 4
    assert _moved(after, before, "pdserve_kv_pushed_blocks_total")[holder] == 4
    assert _moved(after, before, "pdserve_kv_tier_hits_total")[holder] == 4  # SSD (or host)
    assert out2.usage.cached_tokens == 64
    assert [out1.token_ids, out2.token_ids] == [_greedy(engine, [turn1], 4)[0],
                                                _greedy(engine, [turn2], 6)[0]]
    assert not any(wait_idle(cluster).values())


def _prefill(cluster) -> str:
    return cluster.workers("prefill")[0].info["address"]
