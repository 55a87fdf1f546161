"""Reading a request body: JSON only (415 otherwise), bounded in size (413) and in time (408),
parsed strictly (400)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from router.openai.errors import ApiError, body_too_large, request_timeout
from router.openai.schemas import parse_json_body

JSON_TYPE = "application/json"


@dataclass(frozen=True)
class BodyLimits:
    max_bytes: int = 4 * 1024 * 1024
    """Largest body (`RequestLimits.max_body_bytes` in the router)."""
    timeout_s: float = 30.0
    """Longest wait for a body, from the end of its headers."""


async def read_json(request: web.Request, limits: BodyLimits = BodyLimits()) -> Any:
    """The body as JSON. A form, text or other content type is refused with 415 rather than
    read as JSON (vLLM refuses them too); the media type's parameters (charset) are fine.
    A body over the limit is 413 (before it is read, when Content-Length says so); one that
    does not arrive in time is 408."""
    if "pdserve_body" in request:  # already read (/invocations dispatches on it)
        return request["pdserve_body"]
    media = request.headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
    if media != JSON_TYPE:
        raise ApiError(415, f"Unsupported Media Type: only '{JSON_TYPE}' is allowed, got "
                       f"{media or 'no Content-Type'}", "invalid_request_error", None,
                       "unsupported_media_type")
    if request.content_length is not None and request.content_length > limits.max_bytes:
        raise body_too_large(limits.max_bytes)
    try:
        raw = await asyncio.wait_for(request.read(), limits.timeout_s)
    except TimeoutError:
        raise request_timeout("body", limits.timeout_s) from None
    except web.HTTPRequestEntityTooLarge:
        raise body_too_large(limits.max_bytes) from None
    return parse_json_body(raw)
