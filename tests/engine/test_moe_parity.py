"""Qwen3 and the MoE families (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2 and V3 with their
latent attention) equal HF transformers (fp32):
greedy output over ragged batches and chunked prefill, prompt logits, prefix-cache hits and
preemption, and the grouped experts path equals the per-token loop inside the engine."""

from __future__ import annotations

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.models.moe import set_experts_impl
from tests.helpers.checkpoints import VOCAB, hf_greedy, hf_logits
from tests.helpers.engine import assert_idle, random_prompts

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
LENGTHS = (3, 16, 17, 41, 90)
FAMILIES = ["tiny_qwen3", "tiny_mixtral", "tiny_qwen2_moe", "tiny_qwen3_moe",
            "tiny_deepseek_v2", "tiny_deepseek_v3"]


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def expected(checkpoint):
    return hf_greedy(checkpoint, random_prompts(LENGTHS, VOCAB, seed=1), GREEDY.max_tokens)


@pytest.mark.parametrize("chunk", [5, 1024])
def test_greedy_matches_hf_over_ragged_batch(checkpoint, expected, chunk):
    llm = LLM(str(checkpoint), dtype="float32", max_num_batched_tokens=chunk)
    outs = llm.generate(random_prompts(LENGTHS, VOCAB, seed=1), GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert len({tuple(e) for e in expected}) == len(expected)  # outputs are not degenerate
    assert_idle(llm)


def test_prompt_logits_match_hf(checkpoint):
    prompt = random_prompts([60], VOCAB, seed=2)[0]
    llm = LLM(str(checkpoint), dtype="float32")
    assert (llm.engine.prompt_logits(prompt) - hf_logits(checkpoint, prompt)).abs().max() < 1e-4
    assert_idle(llm)


def test_prefix_hits_and_preemption_keep_output_exact(checkpoint):
    shared = random_prompts([48], VOCAB, seed=3)[0]
    prompts = [shared + tail for tail in random_prompts([5, 9, 20], VOCAB, seed=4)]
    prompts += random_prompts([30, 40], VOCAB, seed=5)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    want = hf_greedy(checkpoint, prompts, params.max_tokens)
    # 10 blocks of 16 tokens: the four later sequences (16 blocks, 3 shared) cannot all fit.
    llm = LLM(str(checkpoint), dtype="float32", max_num_batched_tokens=16, num_gpu_blocks=10)
    preempted = _count_preemptions(llm)
    first = llm.generate(prompts[:1], params)
    rest = llm.generate(prompts[1:], params)
    assert [o.token_ids for o in first + rest] == want
    assert all(o.num_cached_tokens >= 48 for o in rest[:2])  # 3 full blocks of the prefix
    assert preempted[0] > 0
    assert_idle(llm)


def test_grouped_experts_equal_the_per_token_loop_in_the_engine(tiny_qwen2_moe):
    prompts = random_prompts([7, 33], VOCAB, seed=6)
    llm = LLM(str(tiny_qwen2_moe), dtype="float32")
    grouped = llm.engine.prompt_logits(prompts[1])
    set_experts_impl(llm.engine.runner.model, "per_token")
    assert (llm.engine.prompt_logits(prompts[1]) - grouped).abs().max() < 1e-5
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == hf_greedy(
        tiny_qwen2_moe, prompts, GREEDY.max_tokens)


def _count_preemptions(llm: LLM) -> list[int]:
    """A one-element counter of the requests the scheduler preempts from now on."""
    count = [0]
    scheduler = llm.engine.scheduler
    schedule = scheduler.schedule

    def counting():
        plan = schedule()
        count[0] += len(plan.preempted)
        return plan

    scheduler.schedule = counting
    return count
