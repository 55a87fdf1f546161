"""JSON pieces every OpenAI response shares: usage, model cards, the logprobs formats.

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


def token_text(tokenizer: Tokenizer, as_ids: bool = False) -> TokenText:
    """One token's text as the logprobs formats show it (special tokens kept), or
    "token_id:N" (vLLM's return_tokens_as_token_ids)."""
    if as_ids:
        return lambda token_id: f"token_id:{token_id}"
    return lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False)


def usage_json(u: Usage, details: bool = False) -> dict:
    out = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
           "total_tokens": u.prompt_tokens + u.completion_tokens,
           "prompt_tokens_details": None}
    if details:
        out["prompt_tokens_details"] = {"cached_tokens": u.cached_tokens}
    return out


def model_json(m: ServedModel, name: str | None = None) -> dict:
    return {"id": name or m.id, "object": "model", "created": m.created, "owned_by": "pdserve",
            "root": m.root or m.id, "parent": None, "max_model_len": m.max_model_len,
            "permission": []}


def models_json(m: ServedModel) -> dict:
    return {"object": "list", "data": [model_json(m, name) for name in m.names]}


def completion_logprobs(lps: Sequence[pb.TokenLogprob], text_of: TokenText, offset: int,
                        top_n: int | None = None) -> dict:
    """The /v1/completions format; `offset` is where the first token's text starts.

    `top_logprobs` holds the sampled token first (as vLLM's does: clients read the chosen
    token as the first key), then the top alternatives, keyed by text: alternatives that
    decode to the same text collapse into one entry. `top_n` caps the alternatives (prompt
    entries carry as many as the prompt was scored with).
    """
    tokens = [text_of(lp.token_id) for lp in lps]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    tops = []
    for tok, lp in zip(tokens, lps, strict=True):
        alts = lp.top if top_n is None else lp.top[:top_n]
        top = {tok: _finite(lp.logprob)}
        for t in alts:
            top.setdefault(text_of(t.token_id), _finite(t.logprob))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [_finite(lp.logprob) for lp in lps],
            "top_logprobs": tops, "text_offset": offsets}


def echo_logprobs(first_token: int, prompt_lps: Sequence[pb.TokenLogprob], text_of: TokenText,
                  top_n: int) -> dict:
    """Completion logprobs of an echoed prompt: its first token has none (null)."""
    rest = completion_logprobs(prompt_lps, text_of, len(text_of(first_token)), top_n)
    return {"tokens": [text_of(first_token)] + rest["tokens"],
            "token_logprobs": [None] + rest["token_logprobs"],
            "top_logprobs": [None] + rest["top_logprobs"],
            "text_offset": [0] + rest["text_offset"]}


def concat_logprobs(a: dict, b: dict) -> dict:
    return {k: a[k] + b[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def prompt_logprobs_json(prompt_lps: Sequence[pb.TokenLogprob], text_of: TokenText,
                         top_n: int) -> list:
    """vLLM's `prompt_logprobs`: null for the first prompt token, then per token
    {token id: {"logprob", "rank", "decoded_token"}} for it (first, as vLLM's) and its top
    `top_n`."""
    out: list = [None]
    for lp in prompt_lps:
        tops = list(enumerate(lp.top[:top_n], 1))
        rank = next((r for r, alt in tops if alt.token_id == lp.token_id),
                    lp.rank if lp.HasField("rank") else None)
        entry = {str(lp.token_id): {"logprob": _finite(lp.logprob), "rank": rank,
                                    "decoded_token": text_of(lp.token_id)}}
        for r, alt in tops:
            entry.setdefault(str(alt.token_id), {"logprob": _finite(alt.logprob), "rank": r,
                                                 "decoded_token": text_of(alt.token_id)})
        out.append(entry)
    return out


def chat_logprobs(lps: Sequence[pb.TokenLogprob], text_of: TokenText) -> dict:
    """The /v1/chat/completions format: {"content": [...], "refusal": null}."""
    content = []
    for lp in lps:
        entry = _chat_entry(text_of(lp.token_id), lp.logprob)
        entry["top_logprobs"] = [_chat_entry(text_of(t.token_id), t.logprob) for t in lp.top]
        content.append(entry)
    return {"content": content, "refusal": None}


def joined(chunks: Sequence[OutputChunk]) -> OutputChunk:
    """One choice's chunks as one (non-streaming responses); its last chunk ends it."""
    last = chunks[-1]
    first_plp = next((c.prompt_logprobs for c in chunks if c.prompt_logprobs), None)
    return OutputChunk([t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks),
                       [lp for c in chunks for lp in c.logprobs], last.finish_reason, last.usage,
                       last.index, first_plp, last.stop_reason)


def _chat_entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode())}


def _finite(x: float) -> float:
    return float(x) if math.isfinite(x) else LOGPROB_FLOOR
