"""JSON pieces every OpenAI response shares: usage, model cards, both logprobs formats.

Pure functions of typed values. Token strings come from a `TokenText` (one token id -> its
text), so the formats are tested without a tokenizer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from pdserve.proto import pb
from pdserve.tokenizer import Tokenizer
from router.frontend import OutputChunk, Usage
from router.openai.schemas import ServedModel

TokenText = Callable[[int], str]

LOGPROB_FLOOR = -9999.0
"""Stands in for -inf (a token the sampler ruled out): JSON has no infinity."""


def token_text(tokenizer: Tokenizer) -> TokenText:
    """One token's text as the logprobs formats show it (special tokens kept)."""
    return lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False)


def usage_json(u: Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def model_json(m: ServedModel) -> dict:
    return {"id": m.id, "object": "model", "created": m.created, "owned_by": "pdserve",
            "max_model_len": m.max_model_len}


def models_json(m: ServedModel) -> dict:
    return {"object": "list", "data": [model_json(m)]}


def completion_logprobs(lps: Sequence[pb.TokenLogprob], text_of: TokenText,
                        offset: int) -> dict:
    """The /v1/completions format; `offset` is where the first token's text starts.

    `top_logprobs` holds the sampled token and the top alternatives (as OpenAI's does), keyed
    by text: alternatives that decode to the same text collapse into one entry.
    """
    tokens = [text_of(lp.token_id) for lp in lps]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    tops = []
    for tok, lp in zip(tokens, lps, strict=True):
        top = {text_of(t.token_id): _finite(t.logprob) for t in lp.top}
        top.setdefault(tok, _finite(lp.logprob))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [_finite(lp.logprob) for lp in lps],
            "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(lps: Sequence[pb.TokenLogprob], text_of: TokenText) -> dict:
    """The /v1/chat/completions format: {"content": [...], "refusal": null}."""
    content = []
    for lp in lps:
        entry = _chat_entry(text_of(lp.token_id), lp.logprob)
        entry["top_logprobs"] = [_chat_entry(text_of(t.token_id), t.logprob) for t in lp.top]
        content.append(entry)
    return {"content": content, "refusal": None}


def joined(chunks: Sequence[OutputChunk]) -> OutputChunk:
    """A whole stream as one chunk (non-streaming responses); the last chunk ends it."""
    last = chunks[-1]
    return OutputChunk([t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks),
                       [lp for c in chunks for lp in c.logprobs], last.finish_reason, last.usage)


def _chat_entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode())}


def _finite(x: float) -> float:
    return float(x) if math.isfinite(x) else LOGPROB_FLOOR
