"""Run one validated request through the frontend and answer it as JSON or as an SSE stream.

    capacity check ─► first chunk ─┬─ not streaming: collect the rest ─► one JSON body
                                   └─ streaming: 200 + head events, one event per chunk,
                                      [usage event], [DONE]
    An error before the first chunk is an HTTP error; after it, a final `data: {"error": ...}`.

Leaving early (client gone: a failed write or the handler cancelled) closes the frontend's
generator, whose flow cancels the worker calls, so the workers free the request's blocks.
"""

from __future__ import annotations

import logging
from contextlib import aclosing
from dataclasses import dataclass
from typing import Protocol

import grpc
from aiohttp import web

from router.flow import FlowError
from router.frontend import Frontend, OutputChunk, Usage
from router.openai import sse
from router.openai.errors import ApiError, from_status
from router.openai.responses import joined
from router.openai.schemas import ServedModel
from router.validation import ValidRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ApiContext:
    """What the endpoint handlers share."""

    frontend: Frontend
    model: ServedModel


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
    if frontend.saturated:
        raise ApiError(429, f"router has {frontend.inflight} requests in flight; retry later",
                       "rate_limit_error", None, "resource_exhausted")
    async with aclosing(frontend.generate(req, None)) as chunks:
        try:
            chunk = await _next(chunks)
            if not stream:
                collected = [chunk] + [c async for c in chunks]
                return web.json_response(shaper.body(joined(collected)), dumps=sse.dumps)
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
