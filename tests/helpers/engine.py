"""Engine test helpers."""

from __future__ import annotations

import torch

from pdserve.engine import LLM


def assert_idle(llm: LLM) -> None:
    """Every block is back on the free list and no request is left in the engine."""
    pool = llm.engine.pool
    assert not llm.engine.has_unfinished(), "requests left in the engine"
    assert pool.is_idle(), f"{pool.num_used} KV blocks still in use"


def random_prompts(lengths, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
