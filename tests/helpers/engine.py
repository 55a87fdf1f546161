"""Engine test helpers."""

from __future__ import annotations

import torch

from pdserve.engine import LLM, SamplingParams


def assert_idle(llm: LLM) -> None:
    """Every block is back on the free list and no request is left in the engine."""
    pool = llm.engine.pool
    assert not llm.engine.has_unfinished(), "requests left in the engine"
    assert pool.is_idle(), f"{pool.num_used} KV blocks still in use"


def random_prompts(lengths, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def greedy_ids(llm: LLM, prompts, max_tokens: int) -> list[list[int]]:
    """The engine's greedy output token ids (EOS ignored): what a cluster must reproduce."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params)]


def check_fp8_kv_on_top(both: LLM, ref: LLM, vocab: int, max_tokens: int) -> None:
    """`both` is `ref`'s weights with an FP8 KV cache: packed uint8 cache, prompt logits within
    E4M3's rounding of `ref`'s (3 mantissa bits for K/V), full greedy runs, nothing leaked."""
    assert both.engine.runner.caches[0].dtype == torch.uint8
    prompt = random_prompts([40], vocab, seed=6)[0]
    want = ref.engine.prompt_logits(prompt)
    got = both.engine.prompt_logits(prompt)
    assert ((got - want).norm() / want.norm()).item() < 0.05
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = both.generate(random_prompts([5, 33], vocab, seed=7), params)
    assert all(len(o.token_ids) == max_tokens for o in outs)
    assert_idle(both)
