"""`POST /v1/chat/completions`: messages -> the model's chat template -> a `chat.completion`.

A stream is `chat.completion.chunk` objects: first a delta with the assistant role, then
content deltas, then an empty delta carrying `finish_reason`.
"""

from __future__ import annotations

import time
import uuid

from aiohttp import web

from router.frontend import OutputChunk, Usage
from router.openai.errors import RequestError
from router.openai.generation import ApiContext, read_json, respond, tokenize
from router.openai.responses import TokenText, chat_logprobs, token_text, usage_json
from router.openai.schemas import parse_chat
from router.validation import ValidRequest, check_prompt_ids


async def handle(request: web.Request, ctx: ApiContext) -> web.StreamResponse:
    req = parse_chat(await read_json(request, ctx), ctx.model)
    tokenizer = ctx.frontend.tokenizer
    try:
        ids = await tokenize(ctx.frontend.tokens.encode_chat([dict(m) for m in req.messages]))
    except RequestError:
        raise
    except ValueError as exc:  # no template, or the template refused these messages
        raise RequestError(f"messages: {exc}", "messages") from None
    check_prompt_ids(ids, ctx.model.limits, "messages")
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    shaper = ChatShaper(rid, int(time.time()), ctx.model.id, token_text(tokenizer),
                        req.logprobs)
    return await respond(request, ctx, ValidRequest(rid, ids, req.params), shaper, req.stream,
                         req.include_usage)


class ChatShaper:
    def __init__(self, rid: str, created: int, model: str, text_of: TokenText,
                 logprobs: bool) -> None:
        self._rid, self._created, self._model = rid, created, model
        self._text_of = text_of
        self._logprobs = logprobs

    def head(self) -> list[dict]:
        return [self._chunk({"role": "assistant", "content": ""}, None, None)]

    def chunk(self, c: OutputChunk) -> dict | None:
        if not c.text and not c.logprobs and c.finish_reason is None:
            return None
        delta = {"content": c.text} if c.text else {}
        return self._chunk(delta, self._lp(c) if c.logprobs else None, c.finish_reason)

    def usage_chunk(self, u: Usage) -> dict:
        return {**self._base("chat.completion.chunk"), "choices": [], "usage": usage_json(u)}

    def body(self, whole: OutputChunk) -> dict:
        message = {"role": "assistant", "content": whole.text, "refusal": None}
        choice = {"index": 0, "message": message, "logprobs": self._lp(whole),
                  "finish_reason": whole.finish_reason}
        usage = usage_json(whole.usage) if whole.usage is not None else None
        return {**self._base("chat.completion"), "choices": [choice], "usage": usage}

    def _chunk(self, delta: dict, logprobs: dict | None, finish: str | None) -> dict:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {**self._base("chat.completion.chunk"), "choices": [choice]}

    def _base(self, obj: str) -> dict:
        return {"id": self._rid, "object": obj, "created": self._created, "model": self._model}

    def _lp(self, c: OutputChunk) -> dict | None:
        return chat_logprobs(c.logprobs, self._text_of) if self._logprobs else None
