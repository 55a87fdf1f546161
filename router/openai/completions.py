"""`POST /v1/completions`: one prompt or a batch (text or token ids) -> a `text_completion`
or its stream. Prompt i's choice j has index i * n + j; `echo` puts the prompt (and, with
`logprobs`, its scored tokens) before the output; echo with max_tokens 0 only scores it."""

from __future__ import annotations

import re
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass

from aiohttp import web

from pdserve.tokenizer import Tokenizer
from router.frontend import OutputChunk, Usage
from router.openai import constraints
from router.openai.body import read_json
from router.openai.generation import ApiContext, respond, tokenize, with_bad_words
from router.openai.responses import (
    TokenText,
    completion_logprobs,
    concat_logprobs,
    echo_logprobs,
    prompt_logprobs_json,
    token_text,
    usage_json,
)
from router.openai.schemas import CompletionRequest, check_prompt_ids, parse_completion
from router.validation import ValidRequest

_ID_UNSAFE = re.compile(r"[^A-Za-z0-9._:-]")


@dataclass(frozen=True)
class PromptView:
    ids: list[int]
    text: str
    """What echo shows: the prompt as sent, or its token ids decoded."""


async def handle(request: web.Request, ctx: ApiContext) -> web.StreamResponse:
    req = parse_completion(await read_json(request, ctx.body), ctx.model, ctx.ignored)
    if req.params.structured is not None:
        await constraints.check(req.params.structured)
    tokenizer = ctx.frontend.tokenizer
    views = await tokenize(ctx, _views, tokenizer, req)
    explicit = req.params.max_tokens if req.max_tokens_explicit and req.generate else None
    for v in views:
        check_prompt_ids(v.ids, ctx.model, "prompt", explicit)
    rid = response_id("cmpl", req.out.request_id)
    params = await with_bad_words(ctx, req.params, req.bad_words)
    valid = [ValidRequest(rid, v.ids, params, req.out.skip_special_tokens) for v in views]
    text_of = token_text(tokenizer, req.out.tokens_as_ids or ctx.tokens_as_ids)
    shaper = CompletionShaper(rid, int(time.time()), ctx.model.id, text_of, req, views,
                              ctx.prompt_tokens_details)
    return await respond(request, ctx, valid, shaper, req.out, req.best_of, req.beam)


def response_id(prefix: str, client_id: str | None) -> str:
    """`prefix-<client id>` (vLLM's request_id), made safe for the workers' ids, else a fresh
    one."""
    if client_id:
        return f"{prefix}-{_ID_UNSAFE.sub('_', client_id)[:128]}"
    return f"{prefix}-{uuid.uuid4().hex}"


def _views(tokenizer: Tokenizer, req: CompletionRequest) -> list[PromptView]:
    out = []
    for p in req.prompts:
        if isinstance(p, str):
            ids, text = tokenizer.encode(p, add_special_tokens=req.add_special_tokens), p
        else:
            ids = list(p)
            text = tokenizer.decode(ids, skip_special_tokens=False) if req.out.echo else ""
        if req.truncation is not None:
            ids = req.truncation.apply(ids)
        out.append(PromptView(ids, text))
    return out


class CompletionShaper:
    """`text_completion` objects; streamed chunks have the same shape as the full response."""

    def __init__(self, rid: str, created: int, model: str, text_of: TokenText,
                 req: CompletionRequest, views: list[PromptView], details: bool) -> None:
        self._base = {"id": rid, "object": "text_completion", "created": created,
                      "model": model}
        self._text_of = text_of
        self._req = req
        self._views = views
        self._details = details
        self._offset: dict[int, int] = defaultdict(int)  # text_offset of the next token
        self._started: set[int] = set()

    def head(self) -> list[tuple[dict, int]]:
        return []

    def chunk(self, c: OutputChunk) -> dict | None:
        first = c.index not in self._started
        self._started.add(c.index)
        choice = self._choice(c, first)
        if not (first or choice["text"] or c.finish_reason is not None
                or (choice["logprobs"] and choice["logprobs"]["tokens"])):
            return None
        return {**self._base, "choices": [choice]}

    def usage(self, u: Usage) -> dict:
        if not self._req.generate:  # echo with max_tokens 0: the token run was dropped
            u = Usage(u.prompt_tokens, 0, u.cached_tokens)
        return usage_json(u, self._details)

    def usage_chunk(self, u: Usage) -> dict:
        return {**self._base, "choices": [], "usage": self.usage(u)}

    def body(self, choices: list[OutputChunk], usage: Usage) -> dict:
        return {**self._base, "choices": [self._choice(c, True) for c in choices],
                "usage": self.usage(usage), "system_fingerprint": None}

    def _choice(self, c: OutputChunk, first: bool) -> dict:
        r = self._req
        view = self._views[c.index // r.out.n]
        ids, text, lps = (c.token_ids, c.text, c.logprobs) if r.generate else ([], "", [])
        finish = c.finish_reason if r.generate or c.finish_reason is None else "length"
        echo = first and r.out.echo
        lp = None
        if r.logprobs is not None:
            lp = completion_logprobs(lps, self._text_of, self._offset[c.index], r.logprobs)
            if echo:
                head = echo_logprobs(view.ids[0], c.prompt_logprobs or [], self._text_of,
                                     r.logprobs)
                ends = head["text_offset"][-1] + len(head["tokens"][-1])
                lp = concat_logprobs(head, completion_logprobs(lps, self._text_of, ends,
                                                               r.logprobs))
            if lp["tokens"]:
                self._offset[c.index] = lp["text_offset"][-1] + len(lp["tokens"][-1])
        choice = {"index": c.index, "text": (view.text if echo else "") + text, "logprobs": lp,
                  "finish_reason": finish, "stop_reason": c.stop_reason,
                  "prompt_logprobs": None}
        if first and r.out.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_json(
                c.prompt_logprobs or [], self._text_of, r.out.prompt_logprobs)
        if r.out.return_token_ids:
            choice["token_ids"] = list(ids)
            if first:
                choice["prompt_token_ids"] = list(view.ids)
        return choice
