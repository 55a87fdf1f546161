"""`POST /v1/chat/completions/batch` (vLLM's): several conversations in one request, each
rendered by the chat template and answered as one choice (`index` = its position), with the
same sampling fields for all. Not streamed; `n` is 1 (vLLM's shape)."""

from __future__ import annotations

import time

from aiohttp import web

from router.frontend import OutputChunk, Usage
from router.openai import constraints
from router.openai.body import read_json
from router.openai.chat import ChatShaper, prepare
from router.openai.completions import response_id
from router.openai.errors import RequestError
from router.openai.generation import ApiContext, respond
from router.openai.schemas import MAX_PROMPTS, parse_chat


async def handle(request: web.Request, ctx: ApiContext) -> web.StreamResponse:
    body = await read_json(request, ctx.body)
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    convs = body.get("messages")
    if not isinstance(convs, list) or not convs or not all(isinstance(c, list) for c in convs):
        raise RequestError("messages must be a non-empty list of conversations, each a list "
                           "of messages", "messages")
    if len(convs) > MAX_PROMPTS:
        raise RequestError(f"at most {MAX_PROMPTS} conversations per request", "messages")
    reqs = [parse_chat({**body, "messages": c}, ctx.model, ctx.tools, ctx.ignored)
            for c in convs]
    first = reqs[0]
    if first.out.stream:
        raise RequestError("batched chat completions cannot be streamed", "stream")
    if first.out.n != 1 or first.beam is not None:
        raise RequestError("batched chat completions take n = 1 and no beam search", "n")
    if first.params.structured is not None:
        await constraints.check(first.params.structured)
    rid = response_id("chatcmpl", first.out.request_id)
    created = int(time.time())
    prepared = [await prepare(ctx, r, rid, created) for r in reqs]
    shaper = BatchShaper([s for _, s in prepared])
    return await respond(request, ctx, [v for v, _ in prepared], shaper, first.out)


class BatchShaper:
    """One `chat.completion` whose choice i is conversation i's answer."""

    def __init__(self, shapers: list[ChatShaper]) -> None:
        self._shapers = shapers

    def head(self) -> list[tuple[dict, int]]:
        return []

    def chunk(self, c: OutputChunk) -> dict | None:
        raise AssertionError("batched chat completions are not streamed")

    def usage(self, u: Usage) -> dict:
        return self._shapers[0].usage(u)

    def usage_chunk(self, u: Usage) -> dict:
        raise AssertionError("batched chat completions are not streamed")

    def body(self, choices: list[OutputChunk], usage: Usage) -> dict:
        out = self._shapers[0].body([], usage)
        out.pop("prompt_token_ids", None)  # one per conversation: not one for the response
        out["choices"] = [self._shapers[c.index].choice(c) for c in choices]
        return out
