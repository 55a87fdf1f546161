"""One client connection through the gRPC front, without I/O: frames pass between the client
and the gRPC server untouched, but a message that announces more bytes than the limit.

    client ─► from_client ─────────────────────────────────────────► gRPC server
                 │ a DATA frame's gRPC message prefix announces > limit bytes:
                 │   the frame is dropped, and so is every later DATA frame of its stream;
                 │   the server gets RST_STREAM(CANCEL) for the stream;
                 │   the client gets the gRPC error (RESOURCE_EXHAUSTED) ending the stream,
                 │   RST_STREAM(NO_ERROR) (stop sending), and a connection WINDOW_UPDATE
                 │   crediting the DATA bytes the server never saw
    client ◄──────────────────────────────────────── from_backend ◄─ gRPC server
                   frames of a refused stream are dropped (their DATA credited back to the
                   server the same way)

Why a front at all: grpc-core refuses such a message from its prefix too, but (grpcio 1.85)
writes the refusal about 100 ms later, after a timer (`docs/perf.md`, issue 12). Here the
refusal leaves with the next write, and the server never spends a byte on the message.

Header blocks (HEADERS, PUSH_PROMISE, CONTINUATION) are always passed on, even on a refused
stream: they carry the HPACK state both peers share. The front's own frames wait while a
header block is open on their way, since nothing may come between HEADERS and its
CONTINUATION (RFC 9113 §6.10).

A stream is tracked from the client's HEADERS until either side ends or resets it; a stream
the front refused is remembered (the last `max_refused`) to drop what is still in flight on it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pdserve.serving.grpc_front.frames import (
    GRPC_PREFIX_BYTES,
    ErrorCode,
    Flag,
    Frame,
    FrameReader,
    FrameType,
    grpc_error_headers,
    rst_stream,
    window_update,
)

RESOURCE_EXHAUSTED = 8  # grpc-status, as grpc-core answers an oversized message
HEADER_BLOCK = (FrameType.HEADERS, FrameType.PUSH_PROMISE, FrameType.CONTINUATION)


@dataclass(frozen=True)
class Output:
    to_backend: bytes = b""
    to_client: bytes = b""


class _Messages:
    """Where a stream's client bytes are in its sequence of gRPC messages."""

    __slots__ = ("prefix", "remaining", "server_started")

    def __init__(self) -> None:
        self.prefix = bytearray()
        self.remaining = 0
        self.server_started = False  # the server sent its response headers

    def over_limit(self, data: memoryview, limit: int) -> int | None:
        """Advance over `data`; the announced length of the first message over `limit`."""
        i, n = 0, len(data)
        while i < n:
            if self.remaining:
                step = min(self.remaining, n - i)
                self.remaining -= step
                i += step
                continue
            step = min(GRPC_PREFIX_BYTES - len(self.prefix), n - i)
            self.prefix += data[i:i + step]
            i += step
            if len(self.prefix) == GRPC_PREFIX_BYTES:
                length = int.from_bytes(self.prefix[1:], "big")
                self.prefix.clear()
                if length > limit:
                    return length
                self.remaining = length
        return None


class _Outbound:
    """Bytes for one peer: the frames passed on, and the front's own frames, held while a
    header block is open on this way."""

    def __init__(self) -> None:
        self._out = bytearray()
        self._held = bytearray()
        self._block_open = False

    def forward(self, f: Frame) -> None:
        self._out += f.raw
        if f.type in HEADER_BLOCK:
            self._block_open = not f.has(Flag.END_HEADERS)
        if not self._block_open and self._held:
            self._out += self._held
            self._held.clear()

    def inject(self, raw: bytes) -> None:
        (self._held if self._block_open else self._out).extend(raw)

    def take(self) -> bytes:
        out = bytes(self._out)
        self._out.clear()
        return out


class GuardedConnection:
    def __init__(self, max_message_bytes: int, max_refused: int = 1024) -> None:
        if max_message_bytes < 0:
            raise ValueError(f"max_message_bytes {max_message_bytes}")
        self._limit = max_message_bytes
        self._max_refused = max_refused
        self._client = FrameReader(preface=True)
        self._backend = FrameReader(preface=False)
        self._to_backend = _Outbound()
        self._to_client = _Outbound()
        self._streams: dict[int, _Messages] = {}
        self._refused: OrderedDict[int, None] = OrderedDict()
        self.refusals = 0

    def from_client(self, data: bytes) -> Output:
        """Raises `FramingError` for bytes that are not HTTP/2 (the front drops the
        connection)."""
        preface, frames = self._client.feed(data)
        self._to_backend.inject(preface)
        dropped = 0
        for f in frames:
            if f.stream in self._refused and f.type not in HEADER_BLOCK:
                dropped += len(f.payload) if f.type == FrameType.DATA else 0
                continue
            if f.type == FrameType.HEADERS and f.stream not in self._streams:
                self._streams[f.stream] = _Messages()
            elif f.type == FrameType.DATA and (stream := self._streams.get(f.stream)):
                announced = stream.over_limit(f.data(), self._limit)
                if announced is not None:
                    dropped += len(f.payload)
                    self._refuse(f.stream, stream, announced)
                    continue
            self._to_backend.forward(f)
            if _ends(f):
                self._streams.pop(f.stream, None)
        if dropped:
            self._to_client.inject(window_update(0, dropped))
        return self._take()

    def from_backend(self, data: bytes) -> Output:
        _, frames = self._backend.feed(data)
        dropped = 0
        for f in frames:
            if f.stream in self._refused and f.type not in HEADER_BLOCK:
                dropped += len(f.payload) if f.type == FrameType.DATA else 0
                continue
            if f.type == FrameType.HEADERS and (stream := self._streams.get(f.stream)):
                stream.server_started = True
            self._to_client.forward(f)
            if _ends(f):  # the server is done with it: nothing more to check
                self._streams.pop(f.stream, None)
        if dropped:
            self._to_backend.inject(window_update(0, dropped))
        return self._take()

    def _refuse(self, stream_id: int, stream: _Messages, announced: int) -> None:
        del self._streams[stream_id]
        self._refused[stream_id] = None
        while len(self._refused) > self._max_refused:
            self._refused.popitem(last=False)
        self.refusals += 1
        self._to_backend.inject(rst_stream(stream_id, ErrorCode.CANCEL))
        message = (f"Received message larger than max ({announced} vs. {self._limit}): "
                   "refused from its length prefix")
        self._to_client.inject(grpc_error_headers(stream_id, RESOURCE_EXHAUSTED, message,
                                                  trailers_only=not stream.server_started))
        self._to_client.inject(rst_stream(stream_id, ErrorCode.NO_ERROR))

    def _take(self) -> Output:
        return Output(self._to_backend.take(), self._to_client.take())


def _ends(f: Frame) -> bool:
    """The frame ends its stream on the sender's side."""
    if f.type == FrameType.RST_STREAM:
        return True
    return f.type in (FrameType.DATA, FrameType.HEADERS) and f.has(Flag.END_STREAM)
