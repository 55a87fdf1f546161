"""Prompt logprobs and logit_bias in the engine: prompt tokens are scored exactly as HF
transformers scores them, across chunked prefill and preemption, never from the prefix cache;
logit_bias moves the argmax."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from tests.helpers.checkpoints import hf_logits
from tests.helpers.engine import assert_idle, random_prompts


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 8},
                                     {"num_gpu_blocks": 6, "max_num_batched_tokens": 16}])
def test_prompt_logprobs_equal_hf(tiny_llama, options):
    llm = LLM(str(tiny_llama), dtype="float32", **{"num_gpu_blocks": 64, **options})
    prompts = random_prompts([19, 33], 512, seed=2)
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                prompt_logprobs=3))
    for prompt, out in zip(prompts, outs, strict=True):
        ref = torch.log_softmax(hf_logits(tiny_llama, prompt), dim=-1)
        assert [lp.token_id for lp in out.prompt_logprobs] == prompt[1:]
        got = torch.tensor([lp.logprob for lp in out.prompt_logprobs])
        want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        top = ref[:-1].topk(3, dim=-1)
        assert [[t for t, _ in lp.top] for lp in out.prompt_logprobs] == top.indices.tolist()
    assert_idle(llm)


def test_prompt_logprobs_never_come_from_the_prefix_cache(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", num_gpu_blocks=64)
    prompt = random_prompts([40], 512, seed=3)[0]
    llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0))  # caches the prompt
    a, b = llm.generate([prompt, prompt], SamplingParams(max_tokens=2, temperature=0,
                                                         prompt_logprobs=0))
    assert a.num_cached_tokens == b.num_cached_tokens == 0
    assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(prompt) - 1
    assert all(lp.top == () for lp in a.prompt_logprobs)


def test_logit_bias_moves_the_greedy_token(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", num_gpu_blocks=64)
    params = dict(max_tokens=4, temperature=0, ignore_eos=True)
    plain = llm.generate([[5, 6, 7]], SamplingParams(**params))[0].token_ids
    forced = llm.generate([[5, 6, 7]], SamplingParams(**params, logit_bias={42: 100}))[0]
    banned = llm.generate([[5, 6, 7]], SamplingParams(**params,
                                                      logit_bias={plain[0]: -100}))[0]
    assert forced.token_ids == [42] * 4
    assert banned.token_ids[0] != plain[0]


def test_prompt_logprobs_and_grammars_under_tensor_parallelism(tiny_llama):
    """Every rank gathers the LM-head rows a chunk scores (they travel in the step plan);
    the grammar's mask is rank 0's, like the sampling."""
    from pdserve.engine.structured import ConstraintKind, StructuredOutput

    prompt = random_prompts([18], 512, seed=6)[0]
    scored = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=2, ignore_eos=True)
    shaped = SamplingParams(max_tokens=20, temperature=0.9, seed=2,
                            structured=StructuredOutput(ConstraintKind.REGEX, "[a-z]{3,8}"))
    with LLM(str(tiny_llama), dtype="float32", num_gpu_blocks=64) as one:
        ref = one.generate([prompt, prompt], [scored, shaped])
    with LLM(str(tiny_llama), dtype="float32", num_gpu_blocks=64, tensor_parallel_size=2,
             max_num_batched_tokens=8) as two:
        got = two.generate([prompt, prompt], [scored, shaped])
    assert got[0].token_ids == ref[0].token_ids
    torch.testing.assert_close(torch.tensor([lp.logprob for lp in got[0].prompt_logprobs]),
                               torch.tensor([lp.logprob for lp in ref[0].prompt_logprobs]),
                               atol=1e-4, rtol=1e-4)
    assert got[1].text == ref[1].text
