"""The wire encoding: compact JSON, and server-sent events (`data: {json}\\n\\n` ... `[DONE]`)."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

DONE = b"data: [DONE]\n\n"


def dumps(obj: Any) -> str:
    # allow_nan=False: NaN/Infinity are not JSON; a value that slipped through is a bug, loudly.
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def event(obj: Any) -> bytes:
    return b"data: " + dumps(obj).encode() + b"\n\n"


async def open_stream(request: web.Request) -> web.StreamResponse:
    """Send the 200 and the event-stream headers; events follow with `resp.write(event(...))`."""
    resp = web.StreamResponse(status=200, headers={
        "Content-Type": "text/event-stream; charset=utf-8",
        "Cache-Control": "no-cache",
        "X-Accel-Buffering": "no",  # proxies (nginx) must not hold events back
    })
    await resp.prepare(request)
    return resp
