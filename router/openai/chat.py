"""`POST /v1/chat/completions`: messages -> the chat template -> a `chat.completion`.

A stream is `chat.completion.chunk` objects: first a delta with the assistant role for each
choice, then content (or `tool_calls`) deltas, the last of each choice carrying its
`finish_reason`. With tools, each choice's text goes through a `ToolCallStream`, which holds
back what may still open a call and turns calls into OpenAI's tool-call deltas.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from aiohttp import web

from pdserve.tokenizer import Tokenizer
from router.frontend import OutputChunk, Usage
from router.openai import constraints
from router.openai.body import read_json
from router.openai.completions import response_id
from router.openai.errors import RequestError
from router.openai.generation import ApiContext, respond, tokenize, with_bad_words
from router.openai.responses import (
    TokenText,
    chat_logprobs,
    prompt_logprobs_json,
    token_text,
    usage_json,
)
from router.openai.schemas import ChatRequest, check_prompt_ids, parse_chat
from router.openai.tool_parsers import ToolParser
from router.openai.tools import (
    ToolCallStream,
    ToolMode,
    call_id,
    output_parser,
    template_messages,
    tool_call_json,
)
from router.validation import ValidRequest

# chat_template_kwargs may not override what the request itself sets.
_RESERVED_KWARGS = frozenset({"messages", "tools", "add_generation_prompt",
                              "continue_final_message", "documents"})


async def handle(request: web.Request, ctx: ApiContext) -> web.StreamResponse:
    req = parse_chat(await read_json(request, ctx.body), ctx.model, ctx.tools, ctx.ignored)
    if req.params.structured is not None:
        await constraints.check(req.params.structured)
    rid = response_id("chatcmpl", req.out.request_id)
    valid, shaper = await prepare(ctx, req, rid, int(time.time()))
    return await respond(request, ctx, [valid], shaper, req.out, beam=req.beam)


async def prepare(ctx: ApiContext, req: ChatRequest, rid: str, created: int
                  ) -> tuple[ValidRequest, ChatShaper]:
    """The conversation rendered, tokenized and checked, and the shaper of its answer."""
    tokenizer = ctx.frontend.tokenizer
    try:
        ids = await tokenize(ctx, encode_chat, tokenizer, req)
    except ValueError as exc:  # no template, or the template refused these messages
        raise RequestError(f"messages: {exc}", "messages") from None
    if req.truncation is not None:
        ids = req.truncation.apply(ids)
    explicit = req.params.max_tokens if req.max_tokens_explicit else None
    check_prompt_ids(ids, ctx.model, "messages", explicit)
    text_of = token_text(tokenizer, req.out.tokens_as_ids or ctx.tokens_as_ids)
    shaper = ChatShaper(rid, created, ctx.model.id, text_of, req, ids,
                        lambda: output_parser(req.tools, ctx.tools), ctx.prompt_tokens_details)
    params = await with_bad_words(ctx, req.params, req.bad_words)
    return ValidRequest(rid, ids, params, req.out.skip_special_tokens), shaper


def encode_chat(tokenizer: Tokenizer, req: ChatRequest) -> list[int]:
    t = req.template
    kwargs = {k: v for k, v in t.kwargs.items() if k not in _RESERVED_KWARGS}
    return tokenizer.encode_chat(template_messages(req.messages), t.add_generation_prompt,
                                 t.continue_final_message,
                                 list(req.tools.definitions) or None, t.add_special_tokens,
                                 **kwargs)


class ChatShaper:
    def __init__(self, rid: str, created: int, model: str, text_of: TokenText,
                 req: ChatRequest, prompt_ids: list[int],
                 make_parser: Callable[[], ToolParser | None], details: bool) -> None:
        self._rid, self._created, self._model = rid, created, model
        self._text_of = text_of
        self._req = req
        self._prompt_ids = prompt_ids
        self._make_parser = make_parser
        self._details = details
        self._streams: dict[int, ToolCallStream | None] = {}
        last = req.messages[-1]
        # vLLM's chat echo: the last message, when it is the assistant's, leads the output.
        self._echo = last["content"] if req.out.echo and last["role"] == "assistant" else ""

    def head(self) -> list[tuple[dict, int]]:
        events = []
        for i in range(self._req.out.n):
            ev = self._chunk({"role": "assistant", "content": self._echo}, i, None, None)
            if i == 0 and self._req.out.return_token_ids:
                ev["prompt_token_ids"] = list(self._prompt_ids)
            events.append((ev, i))
        return events

    def chunk(self, c: OutputChunk) -> dict | None:
        stream = self._stream(c.index)
        content, calls = (c.text, []) if stream is None else stream.feed(
            c.text, c.finish_reason is not None)
        finish = self._finish(c.finish_reason, stream)
        if not (content or calls or c.logprobs or finish is not None or c.token_ids):
            return None
        # Content is a string on every delta without calls, "" included (vLLM's: clients
        # concatenate it unchecked).
        delta: dict = {"content": content} if content or not calls else {}
        if calls:
            delta["tool_calls"] = calls
        ev = self._chunk(delta, c.index, self._lp(c) if c.logprobs else None, finish)
        if finish is not None:  # the choice's last chunk names what stopped it (vLLM's)
            ev["choices"][0]["stop_reason"] = c.stop_reason
        if self._req.out.return_token_ids:
            ev["choices"][0]["token_ids"] = list(c.token_ids)
        return ev

    def usage(self, u: Usage) -> dict:
        return usage_json(u, self._details)

    def usage_chunk(self, u: Usage) -> dict:
        return {**self._base("chat.completion.chunk"), "choices": [], "usage": self.usage(u)}

    def body(self, choices: list[OutputChunk], usage: Usage) -> dict:
        out = self._req.out
        body = {**self._base("chat.completion"), "choices": [self._choice(c) for c in choices],
                "usage": self.usage(usage), "system_fingerprint": None,
                "service_tier": None, "metadata": None, "moderation": None,
                "prompt_logprobs": None}
        if out.prompt_logprobs is not None and choices:
            body["prompt_logprobs"] = prompt_logprobs_json(
                choices[0].prompt_logprobs or [], self._text_of, out.prompt_logprobs)
        if out.return_token_ids:
            body["prompt_token_ids"] = list(self._prompt_ids)
        return body

    def choice(self, c: OutputChunk) -> dict:
        """One choice of the non-streaming response."""
        return self._choice(c)

    def _choice(self, c: OutputChunk) -> dict:
        parser = self._make_parser()
        content: str | None = self._echo + c.text
        calls: list[dict] = []
        if parser is not None:
            parsed = parser.parse(c.text, final=True)
            # Only whole calls: arguments cut short by max_tokens are no call (as OpenAI).
            calls = [tool_call_json(call, call_id()) for call in parsed.calls
                     if call.name is not None and call.complete
                     and _is_json(call.arguments)]
            if self._req.tools.mode is not ToolMode.AUTO:
                content = ""  # the output was the call, generated under its schema
            elif calls:
                text = self._echo + parsed.content
                content = text if text.strip() else None
        # Every field of OpenAI's message, as vLLM answers (clients compare whole objects);
        # no call is a null `tool_calls`, never an empty list.
        message = {"role": "assistant", "content": content, "refusal": None,
                   "annotations": None, "audio": None, "function_call": None,
                   "tool_calls": calls or None, "reasoning_content": None}
        finish = c.finish_reason
        if calls and self._req.tools.mode is not ToolMode.NAMED and finish == "stop":
            finish = "tool_calls"
        choice = {"index": c.index, "message": message, "logprobs": self._lp(c),
                  "finish_reason": finish, "stop_reason": c.stop_reason}
        if self._req.out.return_token_ids:
            choice["token_ids"] = list(c.token_ids)
        return choice

    def _stream(self, index: int) -> ToolCallStream | None:
        if index not in self._streams:
            parser = self._make_parser()
            self._streams[index] = ToolCallStream(parser) if parser is not None else None
        return self._streams[index]

    def _finish(self, reason: str | None, stream: ToolCallStream | None) -> str | None:
        if reason == "stop" and stream is not None and stream.called and \
                self._req.tools.mode is not ToolMode.NAMED:
            return "tool_calls"
        return reason

    def _chunk(self, delta: dict, index: int, logprobs: dict | None, finish: str | None
               ) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {**self._base("chat.completion.chunk"), "choices": [choice]}

    def _base(self, obj: str) -> dict:
        return {"id": self._rid, "object": obj, "created": self._created, "model": self._model}

    def _lp(self, c: OutputChunk) -> dict | None:
        return chat_logprobs(c.logprobs, self._text_of) if self._req.logprobs else None


def _is_json(text: str) -> bool:
    try:
        json.loads(text or "{}")
    except ValueError:
        return False
    return True
