"""A deadline on a connection's first request head (request line and headers), for aiohttp.

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

HEAD_END = b"\r\n\r\n"


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
