"""The model runtime: paged KV cache, continuous batching, prefix caching, sampling."""

from pdserve.engine.finish import FinishReason
from pdserve.engine.llm import LLM, CompletionOutput
from pdserve.engine.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "FinishReason", "SamplingParams"]
