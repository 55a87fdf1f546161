"""Decode pull: a decode worker copies a prompt's prefix from the worker that holds it instead
of recomputing it, and a failed pull only means recomputing."""

from __future__ import annotations

import time

import pytest

from pdserve.client import Client
from pdserve.engine import LLM, SamplingParams
from pdserve.proto import pb, worker_pb, worker_pb_grpc
from tests.helpers.checkpoints import VOCAB
from tests.helpers.cluster import (
    start_cluster,
    wait_idle,
    wait_polled,
    worker_channel,
    worker_stats,
)
from tests.helpers.engine import random_prompts

pytestmark = pytest.mark.timeout(240)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory):
    # Round-robin sends consecutive requests to different decode workers: the second turn of
    # a conversation lands where its prefix is not.
    c = start_cluster(tiny_llama, tmp_path_factory.mktemp("pull"), prefill=1, decode=2,
                      router_args=("--routing", "round-robin"))
    yield c
    c.stop()


def _counters(cluster) -> dict[str, dict[str, float]]:
    return {c.info["address"]: dict(worker_stats(c.info["address"]).counters)
            for c in cluster.children}


def _delta(after, before, key) -> dict[str, float]:
    return {a: after[a].get(key, 0.0) - before[a].get(key, 0.0) for a in after}


def _expected(model, prompts) -> list[list[int]]:
    return [o.token_ids for o in LLM(str(model), dtype="float32").generate(prompts, GREEDY)]


def test_second_turn_on_another_decode_worker_pulls_its_prefix(cluster, tiny_llama):
    turn1 = random_prompts([192], VOCAB, seed=61)[0]  # 12 full blocks
    with Client(cluster.address) as client:
        out1 = client.generate(turn1, max_tokens=6, temperature=0.0, ignore_eos=True)
        wait_polled(cluster)  # the router learns the workers' blocks from its next poll
        before = _counters(cluster)
        turn2 = turn1 + out1.token_ids + random_prompts([12], VOCAB, seed=62)[0]
        out2 = client.generate(turn2, max_tokens=6, temperature=0.0, ignore_eos=True)
    after = _counters(cluster)
    pulled = {a: n for a, n in _delta(after, before, "kv_pulled_blocks").items() if n}
    assert list(pulled.values()) == [12]  # one decode worker pulled turn 1's 12 blocks
    assert sum(_delta(after, before, "kv_pushed_blocks").values()) == 12
    assert not any(_delta(after, before, "kv_pull_failures").values())
    assert not any(_delta(after, before, "prefills").values())  # no prefill worker involved
    assert out2.usage.cached_tokens == 192
    assert out2.token_ids == _expected(tiny_llama, [turn2])[0]
    assert not any(wait_idle(cluster).values())


def _direct_decode(address: str, rid: str, prompt: list[int], source: worker_pb.KVSource):
    """A Decode call straight to a decode worker, as the router would make it."""
    sampling = pb.SamplingParams(max_tokens=GREEDY.max_tokens, temperature=0.0, ignore_eos=True)
    with worker_channel(address) as ch:
        events = list(worker_pb_grpc.WorkerStub(ch).Decode(worker_pb.DecodeRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=sampling, seed=1,
            local_prefill=True, deadline_unix_s=time.time() + 60, kv_source=source),
            timeout=60))
    tokens = [t for ev in events if ev.WhichOneof("event") == "tokens"
              for t in ev.tokens.token_ids]
    return tokens, events[-1].finished


def test_failed_pulls_recompute_and_leak_nothing(cluster, tiny_llama):
    d = cluster.workers("decode")[0].info["address"]
    p = cluster.workers("prefill")[0].info["address"]
    prompts = random_prompts([100, 100], VOCAB, seed=63)  # one each: D caches what it ran
    expected = _expected(tiny_llama, prompts)
    before = _counters(cluster)
    sources = [worker_pb.KVSource(address="127.0.0.1:1", blocks=6),  # nobody there
               worker_pb.KVSource(address=p, blocks=6)]  # holds none of the prompt
    for i, source in enumerate(sources):
        tokens, finished = _direct_decode(d, f"pull-{i}", prompts[i], source)
        assert tokens == expected[i], source.address
        assert finished.cached_tokens == 0, source.address
    after = _counters(cluster)
    assert _delta(after, before, "kv_pulls")[d] == 2
    assert _delta(after, before, "kv_pull_failures")[d] == 2
    assert _delta(after, before, "kv_pulled_blocks")[d] == 0
    assert not any(wait_idle(cluster).values())
