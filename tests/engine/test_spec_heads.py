"""Learned drafters (EAGLE, EAGLE-3, Medusa, MTP) behind the drafter interface: greedy output
is exactly the output without speculation — random heads (drafts rejected) and a fitted EAGLE
head (drafts mostly accepted), under chunked prefill and preemption — for requests prefilled
here and for requests whose prompt KV came from another engine; pools idle afterwards."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.spec.config import SpecConfig
from pdserve.engine.spec.heads.eagle import default_aux_layers
from tests.engine.test_spec_remote_kv import PARAMS as REMOTE_PARAMS
from tests.engine.test_spec_remote_kv import prefill_elsewhere, receive_and_activate
from tests.helpers.checkpoints import VOCAB
from tests.helpers.draft_heads import FIT_TOKENS, fit_prompts
from tests.helpers.engine import assert_idle, random_prompts

BASE = dict(dtype="float32", num_gpu_blocks=256)
OPTIONS = {"plain": {}, "chunked": dict(max_num_batched_tokens=16),
           "preempting": dict(num_gpu_blocks=10)}
K = 3


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def workload():
    prompts = random_prompts([3, 17, 40, 66, 9], VOCAB, seed=21)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
              for m in (20, 33, 12, 30, 25)]
    params[1] = SamplingParams(max_tokens=33, temperature=0.0, repetition_penalty=1.3)
    params[4] = SamplingParams(max_tokens=25, temperature=0.0, min_tokens=10)
    return prompts, params


def _generate(model, spec, prompts, params, **options):
    llm = LLM(str(model), **{**BASE, **options}, speculative_config=spec)
    outs = [o.token_ids for o in llm.generate(prompts, params)]
    return llm, outs


def _idle(llm) -> None:
    assert_idle(llm)
    assert llm.engine.spec.is_idle(), "the drafter still holds per-request state or blocks"


@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("method", ["eagle", "eagle3", "medusa"])
def test_random_heads_change_no_greedy_output(tiny_llama, random_heads, workload, method,
                                              option):
    prompts, params = workload
    ref = [o.token_ids for o in LLM(str(tiny_llama), **BASE).generate(prompts, params)]
    spec = {"method": method, "model": str(random_heads[method]),
            "num_speculative_tokens": K, "adaptive": False}
    llm, got = _generate(tiny_llama, spec, prompts, params, **OPTIONS[option])
    assert got == ref
    assert llm.engine.stats()["spec_drafts_proposed"] > 50
    _idle(llm)


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_a_fitted_eagle_head_is_accepted_and_changes_nothing(tiny_llama, fitted_eagle, option):
    prompts = fit_prompts(VOCAB)
    params = SamplingParams(max_tokens=FIT_TOKENS, temperature=0.0, ignore_eos=True)
    ref = [o.token_ids for o in LLM(str(tiny_llama), **BASE).generate(prompts, params)]
    spec = {"method": "eagle", "model": str(fitted_eagle), "num_speculative_tokens": K,
            "adaptive": False}
    llm, got = _generate(tiny_llama, spec, prompts, params, **OPTIONS[option])
    assert got == ref
    stats = llm.engine.stats()
    assert 0.3 < stats["spec_acceptance_rate"] < 1.0  # both verdicts happen
    assert stats["spec_mean_accepted_length"] > 1.8
    _idle(llm)


def test_mtp_layers_draft_for_deepseek_v3(tiny_deepseek_v3_mtp, workload):
    prompts, params = workload
    ref = [o.token_ids for o in LLM(str(tiny_deepseek_v3_mtp), **BASE).generate(prompts,
                                                                                  params)]
    for option in ("plain", "preempting"):
        llm, got = _generate(tiny_deepseek_v3_mtp, {"method": "mtp", "num_speculative_tokens": 2,
                                                     "adaptive": False},
                             prompts, params, **OPTIONS[option])
        assert got == ref
        assert llm.engine.stats()["spec_drafts_proposed"] > 20
        _idle(llm)


def test_sampled_drafts_are_seeded_and_batch_independent(tiny_llama, fitted_eagle):
    spec = {"method": "eagle", "model": str(fitted_eagle), "num_speculative_tokens": K,
            "adaptive": False}
    target = fit_prompts(VOCAB)[3]
    p = SamplingParams(max_tokens=24, temperature=0.8, top_k=40, seed=99, ignore_eos=True)
    llm = LLM(str(tiny_llama), **BASE, speculative_config=spec)
    alone = llm.generate([target], p)[0].token_ids
    others = random_prompts([12, 50], VOCAB, seed=5)
    mixed = llm.generate([others[0], target, others[1]],
                         [SamplingParams(max_tokens=10, temperature=1.0, seed=1), p,
                          SamplingParams(max_tokens=30, temperature=0.0)])
    assert mixed[1].token_ids == alone and len(alone) == 24
    assert llm.engine.stats()["spec_drafts_accepted"] > 0
    _idle(llm)


def test_a_remotely_prefilled_request_drafts_from_the_hand_off(tiny_llama, fitted_eagle):
    """The decode side never saw the prompt's features: the head's context starts at the
    hand-off, its drafts are still verified exactly and, after a few steps, accepted."""
    prompt = fit_prompts(VOCAB)[0]
    reference = LLM(str(tiny_llama), **BASE).generate([prompt], REMOTE_PARAMS)[0].token_ids
    pre, src_blocks, first = prefill_elsewhere(tiny_llama, prompt)
    dec = LLMEngine(EngineConfig(model=str(tiny_llama), dtype="float32", num_gpu_blocks=32,
                                 speculative_config={"method": "eagle",
                                                     "model": str(fitted_eagle),
                                                     "num_speculative_tokens": K,
                                                     "adaptive": False}))
    receive_and_activate(dec, prompt, pre, src_blocks, first)
    out, contexts = [first], []
    while dec.has_unfinished():
        for o in dec.step():
            out.extend(o.new_token_ids)
        if "r" in dec.scheduler.requests:
            contexts.append(dec.spec.proposer.context("r"))
    assert out == reference
    assert contexts[0][0] == len(prompt)  # the head's KV starts where this engine began
    assert dec.stats()["spec_drafts_accepted"] > 0
    assert dec.spec.is_idle() and dec.pool.is_idle()


@pytest.mark.timeout(300)
def test_tensor_parallel_target_with_an_eagle_head(tiny_llama, fitted_eagle):
    prompts = fit_prompts(VOCAB)[:3]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    ref = [o.token_ids for o in LLM(str(tiny_llama), **BASE).generate(prompts, params)]
    spec = {"method": "eagle", "model": str(fitted_eagle), "num_speculative_tokens": K,
            "adaptive": False}
    with LLM(str(tiny_llama), **BASE, tensor_parallel_size=2, speculative_config=spec) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params)] == ref
        assert llm.engine.stats()["spec_drafts_accepted"] > 0
        _idle(llm)


def test_head_configs_are_checked(tiny_llama, random_heads, tiny_deepseek_v2, tmp_path):
    with pytest.raises(ValueError, match="model"):
        SpecConfig.from_dict({"method": "eagle3", "num_speculative_tokens": 2})
    assert SpecConfig.from_dict({"method": "deepseek_mtp",
                                 "num_speculative_tokens": 1}).method == "mtp"
    with pytest.raises(ValueError, match="3 Medusa heads"):
        LLM(str(tiny_llama), **BASE, speculative_config={
            "method": "medusa", "model": str(random_heads["medusa"]),
            "num_speculative_tokens": 4})
    with pytest.raises(ValueError, match="MTP"):
        LLM(str(tiny_deepseek_v2), **BASE, speculative_config={
            "method": "mtp", "num_speculative_tokens": 1})
    wide = shutil.copytree(random_heads["eagle"], tmp_path / "wide")
    cfg = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**cfg, "hidden_size": 128}))
    with pytest.raises(ValueError, match="hidden size is 64"):
        LLM(str(tiny_llama), **BASE, speculative_config={
            "method": "eagle", "model": str(wide), "num_speculative_tokens": 1})
    assert default_aux_layers(30) == (2, 15, 27) and default_aux_layers(2) == (1, 1, 0)


def test_an_int4_lm_head_leaves_the_drafter_the_dense_one(tiny_llama, fitted_eagle):
    """lm_head_dtype="int4" releases an untied LM head's dense weight: the head reads the
    target's LM head from the checkpoint instead, and output still equals speculation off."""
    from safetensors.torch import load_file

    prompts = fit_prompts(VOCAB)[:2]
    params = SamplingParams(max_tokens=FIT_TOKENS, temperature=0.0, ignore_eos=True)
    opts = dict(quantization="int4", lm_head_dtype="int4")
    ref = [o.token_ids for o in LLM(str(tiny_llama), **BASE, **opts).generate(prompts, params)]
    spec = {"method": "eagle", "model": str(fitted_eagle), "num_speculative_tokens": K,
            "adaptive": False}
    llm, got = _generate(tiny_llama, spec, prompts, params, **opts)
    assert llm.engine.runner.model.lm_head.weight.numel() == 0
    want = load_file(str(tiny_llama / "model.safetensors"))["lm_head.weight"]
    torch.testing.assert_close(llm.engine.spec.proposer.head.lm_head, want)
    assert got == ref and llm.engine.stats()["spec_drafts_accepted"] > 0
    _idle(llm)
