"""A connection before its requests reach the app: a deadline on the first request head, and
OpenAI-shaped answers to malformed HTTP. aiohttp does neither on its own.

`connection_protocol(server, timeout_s)` builds the protocol of one connection: aiohttp's
request handler, its HTTP-level errors (a bad request line, header, chunk size, a line too
long) answered as `{"error": {...}}` JSON instead of plain text (`JsonErrorHandler`), wrapped
in `HeadTimeout`.

aiohttp has no head timeout: a client that trickles its headers holds a connection forever.
`HeadTimeout` wraps the protocol aiohttp builds for a connection and passes everything
through; if the blank line ending the head has not arrived `timeout_s` after the connection
opened, it answers an OpenAI-shaped 408 and closes the connection. Later requests on a
kept-alive connection are bounded by aiohttp's `keepalive_timeout`, which closes a connection
still short of a complete head that long after its last response.

    connection_made ─► timer ─┬─ b"\\r\\n\\r\\n" seen ─► timer off (the body has its own timeout)
                              └─ timer fires ─► 408 + close
"""

from __future__ import annotations

import asyncio
import json
import logging
from http import HTTPStatus

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

log = logging.getLogger(__name__)
HEAD_END = b"\r\n\r\n"


def connection_protocol(server: web.Server, timeout_s: float) -> asyncio.Protocol:
    handler = server()
    handler.__class__ = JsonErrorHandler  # same layout (no slots of its own), one method more
    return HeadTimeout(handler, timeout_s)


class JsonErrorHandler(RequestHandler):
    """aiohttp's handler, with HTTP-level errors as OpenAI error bodies (logged briefly: a
    client's malformed request is not a server fault)."""

    __slots__ = ()

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:
            raise ConnectionError("response already started; cannot send an error")
        what = (message or HTTPStatus(status).phrase).strip().splitlines()[0]
        log.info("malformed HTTP request from %s: %s", request.remote, what)
        body = {"error": {"message": f"malformed HTTP request: {what}",
                          "type": "invalid_request_error" if status < 500 else "server_error",
                          "param": None, "code": None}}
        resp = web.json_response(body, status=status)
        resp.force_close()
        return resp


def _response_408(timeout_s: float) -> bytes:
    body = json.dumps({"error": {
        "message": f"the request headers did not arrive within {timeout_s:g}s",
        "type": "invalid_request_error", "param": None, "code": "request_timeout"}}).encode()
    head = (f"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    return head + body


class HeadTimeout(asyncio.Protocol):
    def __init__(self, inner: asyncio.Protocol, timeout_s: float) -> None:
        self.inner = inner
        self.timeout_s = timeout_s
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._tail = b""  # last bytes seen, so a head end split across reads is found

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._timer = asyncio.get_running_loop().call_later(self.timeout_s, self._expire)
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._timer is not None:
            seen = self._tail + data
            if HEAD_END in seen:
                self._stop_timer()
            else:
                self._tail = seen[-(len(HEAD_END) - 1):]
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        t = self._transport
        if t is not None and not t.is_closing():
            t.write(_response_408(self.timeout_s))
            t.close()
