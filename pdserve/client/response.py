"""Turns `pdserve.v1` response messages into the SDK's dataclasses, and chunks into a Completion.

Pure functions, shared by the sync and async clients. The contract they enforce: a Generate
stream's last message, and only it, carries the finish reason and the usage; a stream that ends
without them is a protocol violation and raises `Internal` rather than returning a silently
truncated answer.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.client.datatypes import (
    Chunk,
    Completion,
    ModelCard,
    TokenLogprob,
    ToolCall,
    TopLogprob,
    Usage,
)
from pdserve.client.errors import Internal
from pdserve.proto import pb

_FINISH_PREFIX = "FINISH_REASON_"


def finish_reason_name(value: int) -> str | None:
    """The finish reason as "stop" / "length" / "abort"; None for UNSPECIFIED.

    A value this client does not know yet (added to the enum later) maps to "unknown".
    """
    if value == pb.FINISH_REASON_UNSPECIFIED:
        return None
    try:
        return pb.FinishReason.Name(value).removeprefix(_FINISH_PREFIX).lower()
    except ValueError:
        return "unknown"


def token_logprob(msg: pb.TokenLogprob) -> TokenLogprob:
    top = [TopLogprob(token_id=t.token_id, logprob=t.logprob) for t in msg.top]
    return TokenLogprob(token_id=msg.token_id, logprob=msg.logprob, top=top)


def usage(msg: pb.Usage) -> Usage:
    return Usage(
        prompt_tokens=msg.prompt_tokens,
        completion_tokens=msg.completion_tokens,
        cached_tokens=msg.cached_tokens,
    )


def chunk(msg: pb.GenerateResponse, *, request_id: str, want_logprobs: bool) -> Chunk:
    """The Chunk for one stream message; request_id fills in when the server left it empty."""
    return Chunk(
        request_id=msg.request_id or request_id,
        token_ids=list(msg.token_ids),
        text=msg.text,
        logprobs=[token_logprob(lp) for lp in msg.logprobs] if want_logprobs else None,
        finish_reason=finish_reason_name(msg.finish_reason),
        usage=usage(msg.usage) if msg.HasField("usage") else None,
        index=msg.index,
        prompt_logprobs=[token_logprob(lp) for lp in msg.prompt_logprobs] or None,
        tool_calls=[ToolCall(c.id, c.name, c.arguments_json) for c in msg.tool_calls],
    )


def assemble(chunks: Sequence[Chunk], *, request_id: str, want_logprobs: bool) -> Completion:
    """Concatenates a finished stream's chunks into its Completion; raises Internal if the
    stream did not end with a finish reason and usage."""
    (one,) = assemble_choices(chunks, request_id=request_id, want_logprobs=want_logprobs,
                              n=1)
    return one


def assemble_choices(chunks: Sequence[Chunk], *, request_id: str, want_logprobs: bool,
                     n: int) -> list[Completion]:
    """Each of `n` choices' chunks joined into its Completion (index order); every one
    carries the request's usage (of all choices). Raises Internal if the stream did not end
    with the usage, or a choice without its finish reason."""
    last = chunks[-1] if chunks else None
    if last is None or last.usage is None:
        raise Internal(f"request {request_id}: stream ended without a finish reason and usage")
    out = []
    for index in range(n):
        mine = [c for c in chunks if c.index == index]
        if not mine or mine[-1].finish_reason is None:
            raise Internal(f"request {request_id}: choice {index} ended without a finish "
                           "reason")
        logprobs = [lp for c in mine for lp in (c.logprobs or ())] if want_logprobs else None
        out.append(Completion(
            request_id=last.request_id,
            token_ids=[t for c in mine for t in c.token_ids],
            text="".join(c.text for c in mine),
            finish_reason=mine[-1].finish_reason,
            usage=last.usage,
            logprobs=logprobs,
            index=index,
            prompt_logprobs=next((c.prompt_logprobs for c in mine if c.prompt_logprobs), None),
            tool_calls=mine[-1].tool_calls,
        ))
    return out


def model_cards(msg: pb.ListModelsResponse) -> list[ModelCard]:
    return [
        ModelCard(id=m.id, max_model_len=m.max_model_len, owned_by=m.owned_by) for m in msg.models
    ]
