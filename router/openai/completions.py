"""`POST /v1/completions`: one prompt (text or token ids) -> a `text_completion` or its stream."""

from __future__ import annotations

import time
import uuid

from aiohttp import web

from router.frontend import OutputChunk, Usage
from router.openai.generation import ApiContext, read_json, respond, tokenize
from router.openai.responses import TokenText, completion_logprobs, token_text, usage_json
from router.openai.schemas import parse_completion
from router.validation import ValidRequest, check_prompt_ids


async def handle(request: web.Request, ctx: ApiContext) -> web.StreamResponse:
    req = parse_completion(await read_json(request, ctx), ctx.model)
    tokenizer = ctx.frontend.tokenizer
    if isinstance(req.prompt, str):
        ids = await tokenize(ctx.frontend.tokens.encode(req.prompt))
    else:
        ids = list(req.prompt)
    check_prompt_ids(ids, ctx.model.limits, "prompt")
    rid = f"cmpl-{uuid.uuid4().hex}"
    shaper = CompletionShaper(rid, int(time.time()), ctx.model.id, token_text(tokenizer),
                              req.params.logprobs is not None)
    return await respond(request, ctx, ValidRequest(rid, ids, req.params), shaper, req.stream,
                         req.include_usage)


class CompletionShaper:
    """`text_completion` objects; streamed chunks have the same shape as the full response."""

    def __init__(self, rid: str, created: int, model: str, text_of: TokenText,
                 logprobs: bool) -> None:
        self._base = {"id": rid, "object": "text_completion", "created": created,
                      "model": model}
        self._text_of = text_of
        self._logprobs = logprobs
        self._offset = 0  # text_offset of the next streamed token

    def head(self) -> list[dict]:
        return []

    def chunk(self, c: OutputChunk) -> dict | None:
        if not c.text and not c.logprobs and c.finish_reason is None:
            return None
        return {**self._base, "choices": [self._choice(c)]}

    def usage_chunk(self, u: Usage) -> dict:
        return {**self._base, "choices": [], "usage": usage_json(u)}

    def body(self, whole: OutputChunk) -> dict:
        usage = usage_json(whole.usage) if whole.usage is not None else None
        return {**self._base, "choices": [self._choice(whole, whole=True)], "usage": usage}

    def _choice(self, c: OutputChunk, whole: bool = False) -> dict:
        lp = None
        if self._logprobs and (c.logprobs or whole):
            lp = completion_logprobs(c.logprobs, self._text_of, self._offset)
            self._offset += sum(len(t) for t in lp["tokens"])
        return {"index": 0, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason}
