"""Model-free pieces of speculative decoding: the adaptive-k policy, n-gram lookup, config."""

from __future__ import annotations

import pytest

from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.spec.adaptive import (
    AdaptiveConfig,
    AdaptiveK,
    CostModel,
    FixedK,
    expected_tokens,
)
from pdserve.engine.spec.config import SpecConfig
from pdserve.engine.spec.ngram import NgramProposer, lookup
from tests.engine.test_scheduler import make, req, run_step

GPU = CostModel(compute_bound_tokens=256)
CPU = CostModel(compute_bound_tokens=4)


def policy(cost: CostModel = GPU, max_k: int = 4, **kw) -> AdaptiveK:
    return AdaptiveK(AdaptiveConfig(max_k=max_k, cost=cost, **kw))


def train(p: AdaptiveK, rid: str, proposed: int, accepted: int, times: int = 30) -> None:
    for _ in range(times):
        p.observe(rid, proposed, accepted)


# -- adaptive k ------------------------------------------------------------------------------


def test_expected_tokens_is_the_truncated_geometric_sum():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_memory_bound_device_with_good_acceptance_speculates_fully():
    p = policy(GPU)
    train(p, "a", 4, 4)
    assert p.choose(["a"], batch_size=1) == {"a": 4}
    assert p.last_k == 4


def test_large_batch_on_a_compute_bound_device_turns_speculation_off():
    p = policy(CPU)
    ids = [f"r{i}" for i in range(64)]
    for rid in ids:
        train(p, rid, 4, 3)  # acceptance 0.75: worth it alone, not in a big batch
    assert set(p.choose(ids, batch_size=64).values()) == {0}
    assert p.last_k == 0
    assert p.choose(["r0"], batch_size=1)["r0"] > 0


def test_low_acceptance_turns_speculation_off_for_that_request_only():
    p = policy(CPU)
    train(p, "good", 4, 4)
    train(p, "bad", 4, 0)
    chosen = p.choose(["good", "bad"], batch_size=2)
    assert chosen["good"] > 0 and chosen["bad"] == 0
    assert p.acceptance("bad") < 0.1 < 0.9 < p.acceptance("good")


def test_low_acceptance_everywhere_turns_speculation_off():
    p = policy(GPU)
    for rid in ("a", "b"):
        train(p, rid, 4, 0)
    assert p.choose(["a", "b"], batch_size=2) == {"a": 0, "b": 0}
    # A new request starts from the (now low) global estimate.
    assert p.acceptance("new") < 0.1 and p.choose(["new"], batch_size=1) == {"new": 0}


def test_a_request_left_without_drafts_is_probed_and_can_recover():
    p = policy(GPU, probe_interval=5)
    train(p, "a", 4, 0)
    ks = [p.choose(["a"], batch_size=1)["a"] for _ in range(5)]
    assert ks == [0, 0, 0, 0, 1]
    train(p, "a", 1, 1, times=40)  # the probes keep succeeding
    assert p.choose(["a"], batch_size=1)["a"] == 4


def test_no_probe_when_even_perfect_drafts_would_not_pay():
    p = policy(CPU, probe_interval=1)
    train(p, "a", 4, 0)
    assert all(p.choose(["a"], batch_size=500)["a"] == 0 for _ in range(3))


def test_draft_cost_lowers_k():
    cheap, costly = policy(GPU, max_k=8), policy(CostModel(256, draft_cost_ratio=0.1), max_k=8)
    for p in (cheap, costly):
        train(p, "a", 4, 3)
    assert 0 < costly.choose(["a"], 1)["a"] < cheap.choose(["a"], 1)["a"]


def test_forget_drops_the_request_estimate():
    p = policy(GPU)
    train(p, "a", 4, 0)
    p.forget("a")
    assert p.acceptance("a") == p.global_acceptance


def test_observe_validates_counts():
    p = policy(GPU)
    with pytest.raises(ValueError, match="accepted"):
        p.observe("a", 2, 3)
    p.observe("a", 0, 0)  # nothing proposed: nothing learned
    assert "a" not in p._requests


def test_adaptive_config_validates():
    with pytest.raises(ValueError, match="max_k"):
        AdaptiveConfig(max_k=0, cost=GPU)
    with pytest.raises(ValueError, match="decay"):
        AdaptiveConfig(max_k=2, cost=GPU, decay=1.0)


def test_fixed_k_always_proposes_k():
    assert FixedK(3).choose(["a", "b"], batch_size=100) == {"a": 3, "b": 3}


# -- n-gram lookup ---------------------------------------------------------------------------


def test_lookup_prefers_the_longest_suffix_match():
    # Suffix [1, 2, 3]: a 3-gram match at the start beats the more recent 1-gram match of 3.
    tokens = [1, 2, 3, 9, 9, 3, 7, 1, 2, 3]
    assert lookup(tokens, 2, max_n=3) == [9, 9]
    assert lookup(tokens, 2, max_n=1) == [7, 1]


def test_lookup_takes_the_most_recent_match():
    tokens = [5, 1, 6, 5, 1, 8, 0, 5, 1]
    assert lookup(tokens, 1, max_n=2) == [8]


def test_lookup_copies_on_over_its_own_proposal():
    assert lookup([4, 7, 8, 7, 8], 5, max_n=2) == [7, 8, 7, 8, 7]
    assert lookup([3, 3, 3], 4, max_n=3) == [3, 3, 3, 3]


def test_lookup_without_a_match_or_below_min_n():
    assert lookup([1, 2, 3, 4], 3, max_n=3) == []
    assert lookup([1, 2, 9, 5, 2], 3, max_n=3, min_n=2) == []
    assert lookup([7], 3, max_n=1) == []


def test_ngram_proposer_honours_k_per_request():
    reqs = [Request(rid, [1, 2, 1, 2, 1], SamplingParams(), seed=0) for rid in "abc"]
    reqs[2].output_token_ids.append(2)
    out = NgramProposer(2).propose(reqs, {"a": 3, "b": 0, "c": 2})
    assert out["a"].token_ids == [2, 1, 2] and out["a"].draft_probs is None
    assert "b" not in out
    assert out["c"].token_ids == [1, 2]


# -- config ----------------------------------------------------------------------------------


def test_spec_config_parses_vllm_style_dicts():
    ng = SpecConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4,
                               "prompt_lookup_max": 5})
    assert (ng.prompt_lookup_max, ng.prompt_lookup_min, ng.adaptive) == (5, 1, True)
    dm = SpecConfig.from_dict({"model": "/x", "num_speculative_tokens": 2})
    assert dm.method == "draft_model" and dm.model == "/x"


@pytest.mark.parametrize("raw, field", [
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4}, "prompt_lookup_min"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "typo"),
    ({"method": "ngram", "num_speculative_tokens": 2, "adaptive": "yes"}, "adaptive"),
])
def test_spec_config_errors_name_the_field(raw, field):
    with pytest.raises(ValueError, match=field):
        SpecConfig.from_dict(raw)


# -- scheduler hook --------------------------------------------------------------------------


def test_release_listeners_hear_of_preemption_and_finish():
    s = make(num_blocks=4, budget=64)
    heard: list[tuple[str, RequestStatus, int]] = []
    s.add_release_listener(lambda r: heard.append((r.request_id, r.status, len(r.block_ids))))
    s.add(req("a", 8))
    s.add(req("b", 8))
    run_step(s)
    run_step(s)  # a grows into a third block: b is preempted
    s.finish("a", RequestStatus.FINISHED_ABORTED)
    s.finish("a", RequestStatus.FINISHED_ABORTED)  # idempotent: no second call
    assert heard == [("b", RequestStatus.WAITING, 0), ("a", RequestStatus.FINISHED_ABORTED, 0)]
