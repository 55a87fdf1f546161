"""KV-aware routing: a conversation's next turn goes where its prefix already is."""

from __future__ import annotations

import pytest

from pdserve.client import Client
from pdserve.engine import LLM, SamplingParams
from tests.helpers.checkpoints import VOCAB
from tests.helpers.cluster import start_cluster, wait_idle, wait_polled, worker_stats
from tests.helpers.engine import random_prompts

pytestmark = pytest.mark.timeout(300)


def _counters(cluster, role):
    return {c.info["address"]: dict(worker_stats(c.info["address"]).counters)
            for c in cluster.workers(role)}


def test_second_turn_lands_on_its_prefix_and_computes_only_new_tokens(tiny_llama, tmp_path):
    cluster = start_cluster(tiny_llama, tmp_path, prefill=2, decode=2)
    try:
        turn1 = random_prompts([200], VOCAB, seed=51)[0]
        with Client(cluster.address) as client:
            out1 = client.generate(turn1, max_tokens=8, temperature=0.0, ignore_eos=True)
            wait_polled(cluster)  # the router learns the workers' blocks from its next poll
            before_p, before_d = _counters(cluster, "prefill"), _counters(cluster, "decode")
            turn2 = turn1 + out1.token_ids + random_prompts([40], VOCAB, seed=52)[0]
            out2 = client.generate(turn2, max_tokens=8, temperature=0.0, ignore_eos=True)
        after_p, after_d = _counters(cluster, "prefill"), _counters(cluster, "decode")

        def delta(after, before, key):
            return {a: after[a].get(key, 0) - before[a].get(key, 0) for a in after}

        # One prefill worker served turn 2, from its cache: it computed only what was new.
        served = {a: n for a, n in delta(after_p, before_p, "prefills").items() if n}
        assert len(served) == 1
        p = next(iter(served))
        assert p == max(before_p, key=lambda a: before_p[a].get("prefills", 0))  # same as turn 1
        assert delta(after_p, before_p, "prefix_hit_tokens")[p] >= 192  # 12 of turn 1's blocks
        # The decode worker that had turn 1 got turn 2, and already held its prefix blocks.
        hits = delta(after_d, before_d, "prefix_hit_blocks")
        assert max(hits.values()) >= 12
        expected = LLM(str(tiny_llama), dtype="float32").generate(
            [turn2], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        assert out2.token_ids == expected[0].token_ids
        assert not any(wait_idle(cluster).values())
    finally:
        cluster.stop()
