"""An MoE checkpoint through the disaggregated cluster: a tensor-parallel prefill worker with
expert parallelism streams KV to a TP=1 decode worker, and workers serving 4-bit experts
(`--quantization int4`) do the same; output equals the engine's."""

from __future__ import annotations

import pytest

from pdserve.client import Client
from pdserve.engine import LLM, SamplingParams
from tests.helpers.checkpoints import VOCAB
from tests.helpers.cluster import start_cluster, wait_idle, worker_stats
from tests.helpers.engine import random_prompts

pytestmark = pytest.mark.timeout(300)
PROMPTS = random_prompts([9, 40, 75, 130], VOCAB, seed=43)  # 9: prefilled on the decode side


# int4: 4-bit experts (and attention) on both workers. Prefill TP=1 there: this checkpoint's
# 64-wide layers quantise in groups of 64, which TP=2 would split (refused at load).
@pytest.mark.parametrize("quantization", [None, "int4"])
def test_moe_cluster_equals_the_engine(tiny_qwen2_moe, tmp_path, quantization):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in LLM(str(tiny_qwen2_moe), dtype="float32",
                                         quantization=quantization).generate(PROMPTS, params)]
    args = ("--quantization", "int4") if quantization else ("--enable-expert-parallel",)
    cluster = start_cluster(tiny_qwen2_moe, tmp_path, prefill_tp=1 if quantization else 2,
                            worker_args=args)
    try:
        with Client(cluster.address) as client:
            got = [client.generate(p, max_tokens=8, temperature=0.0, ignore_eos=True,
                                   timeout=60).token_ids for p in PROMPTS]
        assert got == expected
        decode = worker_stats(cluster.workers("decode")[0].info["address"])
        assert decode.counters["remote_prefills"] >= 3 and decode.counters["local_prefills"] >= 1
        assert not any(wait_idle(cluster).values())
    finally:
        cluster.stop()
