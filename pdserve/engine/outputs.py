"""What the engine hands back after each step (typed, per request)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.finish import FinishReason
from pdserve.engine.sampler import TokenLogprobs


@dataclass(frozen=True)
class StepOutput:
    """New tokens of one request from one step; `finish_reason` is set on its last output."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs | None]
    finish_reason: FinishReason | None  # None while running
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    prompt_logprobs: list[TokenLogprobs] | None = None
    """With `prompt_logprobs` asked: on the request's first output, one entry per prompt token
    after the first."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
