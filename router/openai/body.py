"""Reading a request body: JSON only (415 otherwise), parsed strictly."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from router.openai.errors import ApiError
from router.openai.schemas import parse_json_body

JSON_TYPE = "application/json"


async def read_json(request: web.Request) -> Any:
    """The body as JSON. A form, text or other content type is refused with 415 rather than
    read as JSON (vLLM refuses them too); the media type's parameters (charset) are fine."""
    if "pdserve_body" in request:  # already read (/invocations dispatches on it)
        return request["pdserve_body"]
    media = request.headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
    if media != JSON_TYPE:
        raise ApiError(415, f"Unsupported Media Type: only '{JSON_TYPE}' is allowed, got "
                       f"{media or 'no Content-Type'}", "invalid_request_error", None,
                       "unsupported_media_type")
    return parse_json_body(await request.read())
