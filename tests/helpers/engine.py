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
