"""Greedy output and prompt logits equal HF transformers (fp32), whatever the batching."""

from __future__ import annotations

import pytest

from pdserve.engine import LLM, SamplingParams
from tests.helpers.checkpoints import VOCAB, hf_greedy, hf_logits
from tests.helpers.engine import assert_idle, random_prompts

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
LENGTHS = (3, 16, 17, 41, 90)


@pytest.fixture(params=["tiny_llama", "tiny_llama3", "tiny_qwen2", "tiny_mistral"])
def checkpoint(request):
    return request.getfixturevalue(request.param)


@pytest.mark.parametrize("chunk", [5, 1024])
def test_greedy_matches_hf_over_ragged_batch(checkpoint, chunk):
    prompts = random_prompts(LENGTHS, VOCAB, seed=1)
    expected = hf_greedy(checkpoint, prompts, GREEDY.max_tokens)
    llm = LLM(str(checkpoint), dtype="float32", max_num_batched_tokens=chunk)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert_idle(llm)


def test_prompt_logits_match_hf(checkpoint):
    prompt = random_prompts([60], VOCAB, seed=2)[0]
    llm = LLM(str(checkpoint), dtype="float32")
    ours = llm.engine.prompt_logits(prompt)
    ref = hf_logits(checkpoint, prompt)
    assert (ours - ref).abs().max().item() < 1e-4
    assert_idle(llm)


def test_prefix_cache_hits_keep_output_exact(tiny_llama):
    shared = random_prompts([48], VOCAB, seed=3)[0]
    prompts = [shared + tail for tail in random_prompts([5, 9, 20], VOCAB, seed=4)]
    expected = hf_greedy(tiny_llama, prompts, GREEDY.max_tokens)
    llm = LLM(str(tiny_llama), dtype="float32", max_num_batched_tokens=16)
    first = llm.generate(prompts[:1], GREEDY)
    rest = llm.generate(prompts, GREEDY)
    assert [first[0].token_ids] + [o.token_ids for o in rest[1:]] == expected[:1] + expected[1:]
    assert rest[0].token_ids == expected[0]
    assert all(o.num_cached_tokens >= 48 for o in rest)  # 3 full blocks of the shared prefix
    assert_idle(llm)


def test_preemption_under_block_pressure_keeps_output_exact(tiny_llama):
    prompts = random_prompts([30, 35, 40, 45], VOCAB, seed=5)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = hf_greedy(tiny_llama, prompts, params.max_tokens)
    # 14 blocks of 16 tokens cannot hold four ~60-token sequences at once.
    llm = LLM(str(tiny_llama), dtype="float32", num_gpu_blocks=14,
              enable_prefix_caching=False)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected
    assert_idle(llm)
