"""Learned drafters through the disaggregated cluster: the decode worker drafts for requests
whose prompt a prefill worker computed (its head's context starts at the hand-off; nothing
but KV crosses the wire), and its output equals the single-process engine's without
speculation — an EAGLE head on a Llama target, DeepSeek-V3's MTP layer behind a TP=2
prefill worker."""

from __future__ import annotations

import json

import pytest

from pdserve.client import Client
from pdserve.engine import LLM
from tests.helpers.checkpoints import VOCAB
from tests.helpers.cluster import start_cluster, wait_idle, worker_stats
from tests.helpers.draft_heads import fit_prompts
from tests.helpers.engine import greedy_ids, random_prompts

pytestmark = pytest.mark.timeout(300)


def _run(model, tmp_path, spec: dict, prompts, prefill_tp: int = 1) -> dict[str, float]:
    expected = greedy_ids(LLM(str(model), dtype="float32"), prompts, 24)
    cluster = start_cluster(model, tmp_path, prefill_tp=prefill_tp,
                            worker_args=("--speculative-config", json.dumps(spec)))
    try:
        with Client(cluster.address) as client:
            got = [client.generate(p, max_tokens=24, temperature=0.0, ignore_eos=True,
                                   timeout=60).token_ids for p in prompts]
        assert got == expected
        counters = worker_stats(cluster.workers("decode")[0].info["address"]).counters
        assert counters["remote_prefills"] >= len([p for p in prompts if len(p) > 32])
        assert not any(wait_idle(cluster).values())
        return counters
    finally:
        cluster.stop()


def test_eagle_drafts_for_remotely_prefilled_requests(tiny_llama, fitted_eagle, tmp_path):
    # The head was fitted on these prompts' greedy continuations: a prompt that runs into
    # its own continuation (> 32 tokens: prefilled by P) continues as the head learned.
    fit = fit_prompts(VOCAB)[:4]
    prompts = [p + o[:20] for p, o in zip(fit, greedy_ids(LLM(str(tiny_llama),
                                                              dtype="float32"), fit, 20),
                                          strict=True)]
    counters = _run(tiny_llama, tmp_path, {"method": "eagle", "model": str(fitted_eagle),
                                           "num_speculative_tokens": 3, "adaptive": False},
                    prompts)
    assert counters["spec_drafts_accepted"] > 0


def test_mtp_behind_a_tp2_prefill_worker(tiny_deepseek_v3_mtp, tmp_path):
    prompts = random_prompts([40, 75, 9], VOCAB, seed=44)  # 9: prefilled on the decode side
    counters = _run(tiny_deepseek_v3_mtp, tmp_path, {"method": "mtp", "num_speculative_tokens": 2,
                                                     "adaptive": False}, prompts, prefill_tp=2)
    assert counters["spec_drafts_proposed"] > 0
