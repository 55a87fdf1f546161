"""The model runtime: paged KV cache, continuous batching, prefix caching, sampling.

`LLM` and `CompletionOutput` load on first use: the processes that only read this package's
typed messages and configuration (the router, `pdserve` commands, the launcher) never
import torch, which costs seconds on every start.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.engine.finish import FinishReason
from pdserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.llm import LLM, CompletionOutput

__all__ = ["LLM", "CompletionOutput", "FinishReason", "SamplingParams"]


def __getattr__(name: str) -> object:
    if name in ("LLM", "CompletionOutput"):
        from pdserve.engine import llm

        return getattr(llm, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
