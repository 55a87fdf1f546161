"""The SDK's result types: plain frozen dataclasses, independent of protobuf.

A `Chunk` is one message of a Generate stream; a `Completion` is a whole request's result
(what `generate` returns, and what the chunks of a `stream` add up to). `finish_reason` is a
lowercase string ("stop", "length", "abort") so callers never touch the proto enum.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Usage:
    """Token accounting for one request."""

    prompt_tokens: int
    """Number of prompt tokens."""
    completion_tokens: int
    """Number of generated tokens."""
    cached_tokens: int
    """Prompt tokens served from the KV cache instead of being recomputed."""


@dataclass(frozen=True)
class TopLogprob:
    """One of the most likely alternatives at a position."""

    token_id: int
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """The sampled token at one position, its logprob and the most likely alternatives."""

    token_id: int
    logprob: float
    top: list[TopLogprob]
    """Most likely first; as many as the request's `logprobs`."""


@dataclass(frozen=True)
class ModelCard:
    """A model the deployment serves."""

    id: str
    """The id to pass as `model=`."""
    max_model_len: int
    """Maximum prompt + completion length in tokens."""
    owned_by: str


@dataclass(frozen=True)
class Chunk:
    """One message of a Generate stream: what was produced since the previous one."""

    request_id: str
    token_ids: list[int]
    """Token ids generated since the previous chunk."""
    text: str
    """Text decoded since the previous chunk (may lag token_ids by a partial character)."""
    logprobs: list[TokenLogprob] | None
    """One per token in token_ids when logprobs were requested, else None."""
    finish_reason: str | None
    """On the last chunk: "stop", "length" or "abort"; None before."""
    usage: Usage | None
    """Set on the last chunk only."""


@dataclass(frozen=True)
class Completion:
    """The result of one request: all chunks of its stream put together."""

    request_id: str
    token_ids: list[int]
    """All generated token ids."""
    text: str
    """The generated text."""
    finish_reason: str | None
    """Why generation ended: "stop", "length" or "abort"."""
    usage: Usage
    logprobs: list[TokenLogprob] | None
    """One per generated token when logprobs were requested, else None."""
