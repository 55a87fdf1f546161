"""Read a request body, run one validated request through the frontend, and answer it as JSON
or as an SSE stream.

    body: Content-Length over the limit ─► 413 at once; not all there within body_timeout ─► 408
    admission (first chunk) ─► refused: 429 + Retry-After
                  ─► first chunk ─┬─ not streaming: collect the rest ─► one JSON body
                                   └─ streaming: 200 + head events, one event per chunk,
                                      [usage event], [DONE]
    An error before the first chunk is an HTTP error; after it, a final `data: {"error": ...}`.

Leaving early (client gone: a failed write or the handler cancelled) closes the frontend's
generator, whose flow cancels the worker calls, so the workers free the request's blocks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import grpc
from aiohttp import web

from router.flow import FlowError
from router.frontend import Frontend, OutputChunk, Overloaded, Usage
from router.openai import sse
from router.openai.errors import (
    ApiError,
    body_too_large,
    from_status,
    request_timeout,
    too_many_requests,
)
from router.openai.responses import joined
from router.openai.schemas import ServedModel, parse_json_body
from router.tokenize import TokenizerBusy
from router.validation import ValidRequest

T = TypeVar("T")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ApiContext:
    """What the endpoint handlers share."""

    frontend: Frontend
    model: ServedModel
    max_body_bytes: int = 4 * 1024 * 1024
    body_timeout_s: float = 30.0
    """Longest wait for a request body, from the end of its headers."""


async def read_json(request: web.Request, ctx: ApiContext) -> Any:
    """The request's JSON body: 413 when it is larger than allowed (before reading it, when
    Content-Length says so), 408 when it does not arrive in time, 400 when it is not JSON."""
    if request.content_length is not None and request.content_length > ctx.max_body_bytes:
        raise body_too_large(ctx.max_body_bytes)
    try:
        raw = await asyncio.wait_for(request.read(), ctx.body_timeout_s)
    except TimeoutError:
        raise request_timeout("body", ctx.body_timeout_s) from None
    except web.HTTPRequestEntityTooLarge:
        raise body_too_large(ctx.max_body_bytes) from None
    return parse_json_body(raw)


async def tokenize(job: Awaitable[T]) -> T:
    """A tokenizer job; a busy tokenizer pool is a 429."""
    try:
        return await job
    except TokenizerBusy as exc:
        raise too_many_requests(f"{exc}; retry later", exc.retry_after_s) from None


class Shaper(Protocol):
    """Turns one request's output chunks into an endpoint's JSON (one instance per request)."""

    def head(self) -> list[dict]:
        """Stream events sent before the first output (chat: the role delta)."""

    def chunk(self, c: OutputChunk) -> dict | None:
        """The stream event for one chunk; None when it carries nothing to send."""

    def usage_chunk(self, u: Usage) -> dict:
        """The last stream event when the client asked for usage."""

    def body(self, whole: OutputChunk) -> dict:
        """The non-streaming response for the whole output."""


async def respond(request: web.Request, ctx: ApiContext, req: ValidRequest, shaper: Shaper,
                  stream: bool, include_usage: bool) -> web.StreamResponse:
    frontend = ctx.frontend
    async with aclosing(frontend.generate(req, None)) as chunks:
        try:
            chunk = await _next(chunks)
            if not stream:
                collected = [chunk] + [c async for c in chunks]
                return web.json_response(shaper.body(joined(collected)), dumps=sse.dumps)
        except Overloaded as exc:
            raise too_many_requests(f"{exc}; retry later", exc.retry_after_s) from None
        except FlowError as exc:
            raise from_status(exc.code, str(exc)) from None
        resp = await sse.open_stream(request)
        try:
            await _stream(resp, chunk, chunks, shaper, include_usage, req.request_id)
        except ConnectionResetError:
            log.info("request %s: client went away mid-stream; cancelled", req.request_id)
        return resp


async def _stream(resp: web.StreamResponse, chunk: OutputChunk, chunks, shaper: Shaper,
                  include_usage: bool, rid: str) -> None:
    def send(ev: dict):
        if include_usage:
            ev.setdefault("usage", None)  # OpenAI: every chunk but the last has "usage": null
        return resp.write(sse.event(ev))

    try:
        for ev in shaper.head():
            await send(ev)
        while True:
            ev = shaper.chunk(chunk)
            if ev is not None:
                await send(ev)
            if chunk.usage is not None:
                if include_usage:
                    await send(shaper.usage_chunk(chunk.usage))
                break
            chunk = await _next(chunks)
    except FlowError as exc:
        await resp.write(sse.event(from_status(exc.code, str(exc)).body()))
    except ConnectionResetError:
        raise
    except Exception:  # the 200 is sent: the error can only be an event now
        log.exception("request %s: stream failed", rid)
        await resp.write(sse.event(ApiError(500, "internal server error", "server_error").body()))
    await resp.write(sse.DONE)
    await resp.write_eof()


async def _next(chunks) -> OutputChunk:
    try:
        return await anext(chunks)
    except StopAsyncIteration:
        raise FlowError(grpc.StatusCode.INTERNAL, "the request ended without output") from None
