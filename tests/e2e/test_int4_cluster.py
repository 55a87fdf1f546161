"""W4A16 through the cluster: prefill and decode workers started with --quantization int4 give
the int4 engine's greedy output, whether the prompt is prefilled remotely or by the decode
worker itself, and the workers hash KV blocks under the int4 weights."""

from __future__ import annotations

import pytest

from pdserve.client import Client
from pdserve.engine import LLM
from pdserve.proto import worker_pb, worker_pb_grpc
from tests.helpers.checkpoints import VOCAB, save_tiny
from tests.helpers.cluster import start_cluster, wait_idle, worker_channel
from tests.helpers.engine import greedy_ids, random_prompts

pytestmark = pytest.mark.timeout(300)
PROMPTS = random_prompts([3, 40, 75], VOCAB, seed=43)  # the 3-token one stays on D


@pytest.fixture(scope="module")
def lively_llama(tmp_path_factory):
    # A larger init spread so greedy outputs vary (the default gives near-uniform logits).
    return save_tiny(tmp_path_factory.mktemp("lively"), "llama", seed=7, initializer_range=0.2)


def test_int4_cluster_equals_the_int4_engine(lively_llama, tmp_path):
    llm = LLM(str(lively_llama), dtype="float32", quantization="int4")
    expected = greedy_ids(llm, PROMPTS, 8)
    fp32 = LLM(str(lively_llama), dtype="float32", num_gpu_blocks=8)
    assert fp32.engine.scheduler.kv.hash_extra != llm.engine.scheduler.kv.hash_extra
    cluster = start_cluster(lively_llama, tmp_path, worker_args=("--quantization", "int4"))
    try:
        with Client(cluster.address) as client:
            got = [client.generate(p, max_tokens=8, temperature=0.0, ignore_eos=True,
                                   timeout=60).token_ids for p in PROMPTS]
        assert got == expected
        for worker in cluster.workers("prefill") + cluster.workers("decode"):
            with worker_channel(worker.info["address"]) as ch:
                info = worker_pb_grpc.WorkerStub(ch).GetInfo(worker_pb.InfoRequest(), timeout=10)
            assert info.hash_extra == llm.engine.scheduler.kv.hash_extra
        assert not any(wait_idle(cluster).values())
    finally:
        cluster.stop()
