"""Speculative decoding in the engine: greedy output is exactly the output without it.

Ragged batches under n-gram and draft-model speculation, with chunked prefill and with
preemption, token for token against speculation off; block pools (target and draft) idle
afterwards; seeded sampled requests stay reproducible and batch-independent under a fixed k.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.engine import LLM, SamplingParams
from tests.helpers.checkpoints import VOCAB, save_tiny
from tests.helpers.engine import assert_idle, random_prompts

LENGTHS = [3, 17, 40, 66, 9, 100]
MAX_TOKENS = [20, 33, 12, 40, 25, 30]
BASE = dict(dtype="float32", num_gpu_blocks=256)
OPTIONS = {
    "plain": {},
    "chunked": dict(max_num_batched_tokens=16),
    "preempting": dict(num_gpu_blocks=10),
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny models: a second thread buys nothing and oversubscribes a shared 2-core machine.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    """A smaller, differently initialised model with the same vocabulary: (almost) nothing
    it drafts is accepted."""
    return save_tiny(tmp_path_factory.mktemp("draft"), "llama", seed=5, num_hidden_layers=1)


@pytest.fixture(scope="module")
def noisy_draft(tiny_llama, tmp_path_factory):
    """The target's weights plus noise (a quarter of their scale): about half of its drafts
    are accepted, so verification both accepts and rejects within one step."""
    out = tmp_path_factory.mktemp("noisy")
    shutil.copytree(tiny_llama, out, dirs_exist_ok=True)
    weights = load_file(out / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    noisy = {k: v + 0.005 * torch.randn(v.shape, generator=g) for k, v in weights.items()}
    save_file(noisy, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def workload():
    prompts = random_prompts(LENGTHS, VOCAB, seed=21)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
              for m in MAX_TOKENS]
    # Penalties and min_tokens change the greedy token: the verifier must apply them too.
    params[1] = SamplingParams(max_tokens=33, temperature=0.0, repetition_penalty=1.3,
                               frequency_penalty=0.2)
    params[4] = SamplingParams(max_tokens=25, temperature=0.0, min_tokens=10)
    return prompts, params


@pytest.fixture(scope="module")
def reference(tiny_llama, workload):
    llm = LLM(str(tiny_llama), **BASE)
    return [o.token_ids for o in llm.generate(*workload)]


SPECS = {
    "ngram-fixed": {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
    "ngram-adaptive": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2},
    "draft-self": {"num_speculative_tokens": 3, "adaptive": False},
    "draft-noisy": {"num_speculative_tokens": 3, "adaptive": False},
}


def run_counting_preemptions(llm: LLM, prompts, params):
    preempted: list[str] = []
    schedule = llm.engine.scheduler.schedule

    def spy():
        plan = schedule()
        preempted.extend(plan.preempted)
        return plan

    llm.engine.scheduler.schedule = spy
    outs = llm.generate(prompts, params)
    return [o.token_ids for o in outs], preempted


def assert_all_idle(llm: LLM) -> None:
    assert_idle(llm)
    assert llm.engine.spec.is_idle(), "the drafter still holds per-request state or blocks"


@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("method", sorted(SPECS))
def test_greedy_output_equals_speculation_off(tiny_llama, noisy_draft, workload, reference,
                                              method, option):
    spec = dict(SPECS[method])
    if method.startswith("draft"):
        spec["model"] = str(tiny_llama if method == "draft-self" else noisy_draft)
    llm = LLM(str(tiny_llama), **{**BASE, **OPTIONS[option]}, speculative_config=spec)
    got, preempted = run_counting_preemptions(llm, *workload)
    assert got == reference
    if option == "preempting":
        assert preempted, "the small pool should have forced a preemption"
    stats = llm.engine.stats()
    assert 0 < stats["spec_drafts_accepted"] <= stats["spec_drafts_proposed"]
    if method == "draft-self":
        assert stats["spec_acceptance_rate"] > 0.9
        assert stats["spec_mean_accepted_length"] > 2.5
    if method == "draft-noisy":
        assert 0.2 < stats["spec_acceptance_rate"] < 0.8
    assert_all_idle(llm)


def test_a_draft_model_that_is_always_wrong_changes_nothing(tiny_llama, other_draft, workload,
                                                           reference):
    llm = LLM(str(tiny_llama), **BASE, speculative_config={
        "model": str(other_draft), "num_speculative_tokens": 2, "adaptive": False})
    assert [o.token_ids for o in llm.generate(*workload)] == reference
    assert llm.engine.stats()["spec_drafts_proposed"] > 100
    assert_all_idle(llm)


def test_stop_token_inside_accepted_drafts_cuts_the_output(tiny_llama, workload, reference):
    prompts, _ = workload
    stop_at = reference[3][7]
    first = reference[3].index(stop_at)
    llm = LLM(str(tiny_llama), **BASE, speculative_config={
        "model": str(tiny_llama), "num_speculative_tokens": 4, "adaptive": False})
    out = llm.generate([prompts[3]], SamplingParams(max_tokens=40, temperature=0.0,
                                                    ignore_eos=True, stop_token_ids=[stop_at]))
    assert out[0].token_ids == reference[3][:first + 1] and out[0].finish_reason == "stop"
    assert_all_idle(llm)


def test_context_limit_caps_the_drafts(tiny_llama):
    prompt = random_prompts([50], VOCAB, seed=3)[0]
    p = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    off = LLM(str(tiny_llama), **BASE, max_model_len=64).generate([prompt], p)[0]
    llm = LLM(str(tiny_llama), **BASE, max_model_len=64, speculative_config={
        "method": "ngram", "num_speculative_tokens": 8, "adaptive": False})
    on = llm.generate([prompt], p)[0]
    assert on.token_ids == off.token_ids and on.finish_reason == off.finish_reason == "length"
    assert len(on.token_ids) == 14
    assert_all_idle(llm)


def test_greedy_logprobs_match_speculation_off(tiny_llama, workload):
    prompts, _ = workload
    p = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
    off = LLM(str(tiny_llama), **BASE).generate(prompts[:3], p)
    on = LLM(str(tiny_llama), **BASE, speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "adaptive": False}).generate(
            prompts[:3], p)
    for a, b in zip(off, on, strict=True):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs, strict=True):
            assert la.token_id == lb.token_id
            assert la.logprob == pytest.approx(lb.logprob, abs=1e-4)
            assert [t for t, _ in la.top] == [t for t, _ in lb.top]


def test_seeded_sampling_is_batch_independent_under_fixed_k(tiny_llama):
    llm = LLM(str(tiny_llama), **BASE, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "adaptive": False})
    target = random_prompts([30], VOCAB, seed=4)[0]
    p = SamplingParams(max_tokens=24, temperature=0.8, top_k=40, seed=99, ignore_eos=True)
    alone = llm.generate([target], p)[0].token_ids
    others = random_prompts([12, 50], VOCAB, seed=5)
    mixed = llm.generate([others[0], target, others[1]],
                         [SamplingParams(max_tokens=10, temperature=1.0, seed=1),
                          p, SamplingParams(max_tokens=30, temperature=0.0)])
    assert mixed[1].token_ids == alone and len(alone) == 24
    assert llm.engine.stats()["spec_drafts_proposed"] > 0
    assert_all_idle(llm)


def test_sampled_drafts_from_a_draft_model(tiny_llama, other_draft):
    spec = {"model": str(other_draft), "num_speculative_tokens": 3, "adaptive": False}
    prompts = random_prompts([8, 25, 60], VOCAB, seed=6)
    params = [SamplingParams(max_tokens=20, temperature=t, seed=s, ignore_eos=True, top_p=0.95)
              for t, s in ((0.7, 1), (1.0, 2), (1.3, 3))]
    runs = []
    for _ in range(2):
        llm = LLM(str(tiny_llama), **BASE, speculative_config=spec)
        runs.append([o.token_ids for o in llm.generate(prompts, params)])
        assert llm.engine.stats()["spec_verify_steps"] > 0
        assert_all_idle(llm)
    assert runs[0] == runs[1] and all(len(t) == 20 for t in runs[0])


def test_stats_keys_exist_without_speculation(tiny_llama):
    stats = LLM(str(tiny_llama), **BASE).engine.stats()
    assert stats["spec_drafts_proposed"] == 0 and stats["spec_acceptance_rate"] == 0.0


def test_bad_speculative_config_is_rejected(tiny_llama):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(str(tiny_llama), **BASE, speculative_config={"method": "ngram"})


def test_a_prompt_whose_last_token_is_left_alone_keeps_a_seeded_output(tiny_llama):
    # Chunks of 16 leave the 33-token prompt's last token alone for a step (as a forked
    # choice's is): that step samples the first token plainly, as the unchunked run does,
    # and does not verify drafts for it.
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "adaptive": False}
    prompt = random_prompts([33], VOCAB, seed=8)[0]
    prompt[-3:] = prompt[:3]  # something for the n-gram lookup to draft from
    p = SamplingParams(max_tokens=16, temperature=1.0, seed=5, ignore_eos=True)
    outs = []
    for chunk in ({}, dict(max_num_batched_tokens=16)):
        llm = LLM(str(tiny_llama), **BASE, **chunk, speculative_config=spec)
        outs.append(llm.generate([prompt], p)[0].token_ids)
        assert_all_idle(llm)
    assert outs[0] == outs[1] and len(outs[0]) == 16
