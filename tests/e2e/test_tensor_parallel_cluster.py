"""Tensor-parallel prefill and decode workers of different degrees, end to end.

KV heads are re-sharded in transit: each decode rank receives exactly its heads, from
whichever prefill ranks hold them. Greedy output equals the TP=1 single-process engine.
"""

from __future__ import annotations

import signal
import time

import grpc
import pytest

from pdserve.client import Client, PDServeError
from pdserve.engine import LLM, SamplingParams
from tests.helpers.checkpoints import VOCAB, save_tiny
from tests.helpers.cluster import start_cluster, wait_idle, worker_stats
from tests.helpers.engine import random_prompts

pytestmark = pytest.mark.timeout(300)
PROMPTS = random_prompts([40, 75, 130], VOCAB, seed=41)  # all prefilled remotely


@pytest.fixture(scope="module")
def lively_llama(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("lively"), "llama", seed=7, initializer_range=0.2,
                     attention_bias=True)


def _expected(path) -> list[list[int]]:
    llm = LLM(str(path), dtype="float32")
    return [o.token_ids for o in llm.generate(
        PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))]


@pytest.mark.parametrize("ckpt, prefill_tp, decode_tp, reads", [
    ("lively_llama", 2, 1, True),   # two prefill ranks send their head halves to one rank
    ("tiny_qwen2", 1, 2, True),     # one prefill rank splits its heads over two decode ranks
    # one KV head, replicated on every rank: sent once per receiver; written into the
    # landing pools (the flag reaches the follower ranks too)
    ("tiny_llama3", 2, 2, False),
])
def test_cluster_with_different_tp_degrees_equals_the_engine(request, tmp_path, ckpt,
                                                              prefill_tp, decode_tp, reads):
    path = request.getfixturevalue(ckpt)
    expected = _expected(path)
    cluster = start_cluster(path, tmp_path, prefill_tp=prefill_tp, decode_tp=decode_tp,
                            worker_args=() if reads else ("--no-kv-nixl-reads",))
    try:
        with Client(cluster.address) as client:
            got = [client.generate(p, max_tokens=8, temperature=0.0, ignore_eos=True,
                                   timeout=60).token_ids for p in PROMPTS]
        assert got == expected
        assert not any(wait_idle(cluster).values())
        # decode rank 0's receiver: what came through NIXL was read in place, or written
        decode = worker_stats(cluster.workers("decode")[0].info["address"]).counters
        nixl = decode["kv_bytes_received_nixl"]
        assert decode["kv_bytes_read_nixl"] == (nixl if reads else 0)
        on_nixl = {c.info["kv_transport"] for c in cluster.children} == {"nixl"}
        assert nixl == (decode["kv_bytes_received"] if on_nixl else 0)
    finally:
        cluster.stop()


def test_a_killed_decode_rank_takes_its_group_out_of_service(lively_llama, tmp_path):
    cluster = start_cluster(lively_llama, tmp_path, prefill=1, decode=2, decode_tp=2)
    try:
        victim = cluster.workers("decode")[0]
        followers = _children_of(victim.proc.pid)
        assert followers, "the decode worker should have a follower rank process"
        for pid in followers:
            _kill(pid)
        # In-flight or new requests on the broken group fail fast with UNAVAILABLE; within a
        # few seconds the router sends everything to the healthy group.
        deadline = time.monotonic() + 30
        ok = 0
        with Client(cluster.address, max_retries=0) as client:
            while ok < 4:
                assert time.monotonic() < deadline, "router kept using the broken group"
                try:
                    out = client.generate(PROMPTS[0], max_tokens=4, temperature=0.0,
                                          ignore_eos=True, timeout=20)
                    assert len(out.token_ids) == 4
                    ok += 1
                except PDServeError as err:
                    assert err.code == grpc.StatusCode.UNAVAILABLE, err
                    ok = 0
                    time.sleep(0.5)
    finally:
        cluster.stop()


def _children_of(pid: int) -> list[int]:
    from pathlib import Path

    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children = (task / "children").read_text().split()
        out.extend(int(c) for c in children)
    return out


def _kill(pid: int) -> None:
    import os

    os.kill(pid, signal.SIGKILL)
