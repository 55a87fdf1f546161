"""The SDK's result types: plain frozen dataclasses, independent of protobuf.

A `Chunk` is one message of a Generate stream; a `Completion` is a whole request's result
(what `generate` returns, and what the chunks of a `stream` add up to). `finish_reason` is a
lowercase string ("stop", "length", "abort") so callers never touch the proto enum.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


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
class ToolCall:
    """A call of one of the chat's tools, as the model made it."""

    id: str
    name: str
    arguments: str
    """The arguments, as JSON text."""


@dataclass(frozen=True)
class Chat:
    """A conversation prompt: rendered by the served model's chat template on the server.

    `messages` and `tools` are OpenAI-style dicts: {"role", "content"[, "name",
    "tool_calls", "tool_call_id"]} and {"type": "function", "function": {"name",
    "description", "parameters"}}. `tool_choice`: "none", "auto", "required", or a tool's
    name (that call, constrained to its schema).
    """

    messages: Sequence[Mapping[str, Any]]
    tools: Sequence[Mapping[str, Any]] = ()
    tool_choice: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)


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
    """Set on the last chunk only (with n > 1: of all choices together)."""
    index: int = 0
    """The choice this chunk belongs to (n > 1: choices interleave)."""
    prompt_logprobs: list[TokenLogprob] | None = None
    """With prompt_logprobs: on a choice's first chunk, one per prompt token after the
    first."""
    tool_calls: list[ToolCall] = field(default_factory=list)
    """Chat prompts with tools: on a choice's last chunk, the calls it made."""


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
    index: int = 0
    """Which choice (generate_choices)."""
    prompt_logprobs: list[TokenLogprob] | None = None
    """With prompt_logprobs: one per prompt token after the first."""
    tool_calls: list[ToolCall] = field(default_factory=list)
    """Chat prompts with tools: the calls the model made (finish_reason "tool_calls")."""
