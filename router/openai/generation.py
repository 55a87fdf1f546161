"""Run one validated request (one prompt or a batch, each with one or more choices) through
the frontend and answer it as JSON or as an SSE stream.

    the choices' chunks: the frontend's flows, or a beam search's (`beam_search.py`)
    admission (first chunk) ─► refused: 429 + Retry-After
                  ─► first chunk ─┬─ not streaming: collect every choice ─► one JSON body
                                  │  (best_of > n: the n with the highest total logprob)
                                  └─ streaming: 200 + head events, one event per chunk of
                                     any choice (interleaved, tagged with its index),
                                     [usage event], [DONE]
    An error before the first chunk is an HTTP error; after it, a final `data: {"error": ...}`.

Leaving early (client gone: a failed write or the handler cancelled) closes the frontend's
generator, whose flows cancel the worker calls, so the workers free the request's blocks.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Protocol, TypeVar

import grpc
from aiohttp import web

from pdserve.engine.sampling_params import SamplingParams
from pdserve.tokenizer import Tokenizer
from router.flow import FlowError
from router.frontend import Frontend, OutputChunk, Overloaded, Usage, UsageTotal
from router.openai import sse
from router.openai.beam_search import beam_chunks
from router.openai.body import BodyLimits
from router.openai.errors import ApiError, from_status, too_many_requests
from router.openai.responses import joined
from router.openai.schemas import (
    BeamOptions,
    IgnoredFields,
    OutputOptions,
    ServedModel,
    StreamOptions,
)
from router.openai.tools import ToolConfig
from router.tokenize import TokenizerBusy
from router.validation import ValidRequest

T = TypeVar("T")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ApiContext:
    """What the endpoint handlers share."""

    frontend: Frontend
    model: ServedModel
    tools: ToolConfig = ToolConfig()
    ignored: IgnoredFields = field(default_factory=lambda: IgnoredFields(log))
    prompt_tokens_details: bool = False
    """usage.prompt_tokens_details (cached tokens), vLLM's --enable-prompt-tokens-details."""
    body: BodyLimits = BodyLimits()
    tokens_as_ids: bool = False
    """--return-tokens-as-token-ids: logprobs name tokens "token_id:N" for every request."""
    force_include_usage: bool = False
    """--enable-force-include-usage: streams carry usage on every chunk and at the end."""


async def tokenize(ctx: ApiContext, fn: Callable[..., T], *args) -> T:
    """`fn(*args)` (tokenizer work, bounded by the request's checks) on the frontend's
    tokenizer pool, off the event loop; a busy pool is a 429."""
    try:
        return await ctx.frontend.tokens.run(fn, *args)
    except TokenizerBusy as exc:
        raise too_many_requests(f"{exc}; retry later", exc.retry_after_s) from None


def bad_words_token_ids(tokenizer: Tokenizer, words: Sequence[str]
                        ) -> tuple[tuple[int, ...], ...]:
    """vLLM's tokenization of bad_words: each word as it starts a text, and also after a
    space where that spells it with other tokens of the same count (a word mid-text)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if plain:
            out.append(plain)
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return tuple(out)


async def with_bad_words(ctx: ApiContext, params: SamplingParams, words: Sequence[str]
                         ) -> SamplingParams:
    """`params` with the request's bad_words as token sequences (tokenized off the loop)."""
    if not words:
        return params
    seqs = await tokenize(ctx, bad_words_token_ids, ctx.frontend.tokenizer, words)
    return replace(params, bad_words_token_ids=seqs)


class Shaper(Protocol):
    """Turns one request's output chunks into an endpoint's JSON (one instance per request)."""

    def head(self) -> list[tuple[dict, int]]:
        """Stream events sent before any output, each with its choice (chat: role deltas)."""

    def chunk(self, c: OutputChunk) -> dict | None:
        """The stream event for one chunk; None when it carries nothing to send."""

    def usage_chunk(self, u: Usage) -> dict:
        """The last stream event when the client asked for usage."""

    def usage(self, u: Usage) -> dict:
        """The `usage` object for `u`."""

    def body(self, choices: list[OutputChunk], usage: Usage) -> dict:
        """The non-streaming response: each choice's whole output, in index order."""


async def respond(request: web.Request, ctx: ApiContext, reqs: Sequence[ValidRequest],
                  shaper: Shaper, out: OutputOptions, best_of: int | None = None,
                  beam: BeamOptions | None = None) -> web.StreamResponse:
    frontend = ctx.frontend
    if ctx.force_include_usage and out.stream:
        out = replace(out, stream_options=StreamOptions(True, True))
    per_prompt = out.n if beam is not None else best_of or out.n
    source = frontend.generate_choices(reqs, per_prompt, None) if beam is None else \
        beam_chunks(frontend, reqs, beam, ctx.model.max_model_len)
    async with aclosing(source) as chunks:
        try:
            chunk = await _next(chunks)
            if not out.stream:
                collected = [chunk] + [c async for c in chunks]
                choices, usage = _whole(collected, len(reqs), per_prompt, out.n)
                return web.json_response(shaper.body(choices, usage), dumps=sse.dumps)
        except Overloaded as exc:
            raise too_many_requests(f"{exc}; retry later", exc.retry_after_s) from None
        except FlowError as exc:
            raise from_status(exc.code, str(exc)) from None
        resp = await sse.open_stream(request)
        try:
            await _stream(resp, chunk, chunks, shaper, out, reqs)
        except ConnectionResetError:
            log.info("request %s: client went away mid-stream; cancelled", reqs[0].request_id)
        return resp


def _whole(chunks: list[OutputChunk], prompts: int, per_prompt: int, n: int
           ) -> tuple[list[OutputChunk], Usage]:
    """Every choice's output joined; with best_of > n, each prompt's n best (highest total
    logprob), renumbered 0 .. prompts * n - 1."""
    by_index: dict[int, list[OutputChunk]] = defaultdict(list)
    usage = UsageTotal(per_prompt)
    for c in chunks:
        by_index[c.index].append(c)
        if c.usage is not None:
            usage.add(c.usage, c.index)
    whole = [joined(by_index[i]) for i in range(prompts * per_prompt)]
    if per_prompt == n:
        return whole, usage.total()
    best = []
    for p in range(prompts):
        group = whole[p * per_prompt:(p + 1) * per_prompt]
        group.sort(key=lambda c: -sum(lp.logprob for lp in c.logprobs))
        best.extend(replace(c, index=p * n + j) for j, c in enumerate(group[:n]))
    return best, usage.total()


async def _stream(resp: web.StreamResponse, chunk: OutputChunk, chunks, shaper: Shaper,
                  out: OutputOptions, reqs: Sequence[ValidRequest]) -> None:
    opts = out.stream_options
    total = UsageTotal(out.n)
    sent: dict[int, int] = defaultdict(int)  # completion tokens streamed per choice

    def send(ev: dict, index: int):
        if opts.include_usage and "usage" not in ev:
            # OpenAI: every chunk but the last has "usage": null; vLLM's continuous usage
            # stats put the choice's usage so far on every chunk instead.
            prompt = len(reqs[index // out.n].prompt_token_ids)
            ev["usage"] = shaper.usage(Usage(prompt, sent[index], 0)) \
                if opts.continuous_usage_stats else None
        return resp.write(sse.event(ev))

    try:
        for ev, index in shaper.head():
            await send(ev, index)
        while True:
            sent[chunk.index] += len(chunk.token_ids)
            ev = shaper.chunk(chunk)
            if ev is not None:
                await send(ev, chunk.index)
            if chunk.usage is not None:
                total.add(chunk.usage, chunk.index)
                if total.finished == len(reqs) * out.n:
                    if opts.include_usage:
                        await resp.write(sse.event(shaper.usage_chunk(total.total())))
                    break
            chunk = await _next(chunks)
    except FlowError as exc:
        await resp.write(sse.event(from_status(exc.code, str(exc)).body()))
    except ConnectionResetError:
        raise
    except Exception:  # the 200 is sent: the error can only be an event now
        log.exception("request %s: stream failed", reqs[0].request_id)
        await resp.write(sse.event(ApiError(500, "internal server error", "server_error").body()))
    await resp.write(sse.DONE)
    await resp.write_eof()


async def _next(chunks) -> OutputChunk:
    try:
        return await anext(chunks)
    except StopAsyncIteration:
        raise FlowError(grpc.StatusCode.INTERNAL, "the request ended without output") from None
