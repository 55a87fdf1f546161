"""HTTP/2 framing (RFC 9113 §4) as far as the gRPC front needs it: split a byte stream into
whole frames, and write the few frames the front sends on its own.

The front never decodes header blocks. The frames it writes carry header fields only as
HPACK literals "without indexing" (RFC 7541 §6.2.2) or static-table references, which leave
both peers' dynamic tables as they were: the connection's compression state stays the two
peers' own.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HEADER_BYTES = 9
MAX_FRAME_BYTES = (1 << 24) - 1  # the largest length a frame header can announce
GRPC_PREFIX_BYTES = 5  # one message: compressed flag (1 byte), length (4 bytes, big-endian)


class FrameType(IntEnum):
    DATA = 0x0
    HEADERS = 0x1
    PRIORITY = 0x2
    RST_STREAM = 0x3
    SETTINGS = 0x4
    PUSH_PROMISE = 0x5
    PING = 0x6
    GOAWAY = 0x7
    WINDOW_UPDATE = 0x8
    CONTINUATION = 0x9


class Flag(IntEnum):
    END_STREAM = 0x1
    END_HEADERS = 0x4
    PADDED = 0x8


class ErrorCode(IntEnum):
    NO_ERROR = 0x0
    PROTOCOL_ERROR = 0x1
    CANCEL = 0x8


class FramingError(ValueError):
    """Bytes that are not HTTP/2 (a wrong preface, a DATA frame's padding past its end)."""


@dataclass(frozen=True)
class Frame:
    type: int
    """A `FrameType` value, or an unknown type (passed on untouched, as RFC 9113 §4.1 asks)."""
    flags: int
    stream: int
    raw: bytes
    """The whole frame, header included, exactly as it arrived."""

    @property
    def payload(self) -> memoryview:
        return memoryview(self.raw)[HEADER_BYTES:]

    def has(self, flag: Flag) -> bool:
        return bool(self.flags & flag)

    def data(self) -> memoryview:
        """A DATA frame's application bytes: its payload without the padding."""
        payload = self.payload
        if not self.has(Flag.PADDED):
            return payload
        if not payload or payload[0] >= len(payload):
            raise FramingError(f"DATA frame on stream {self.stream}: padding past its end")
        return payload[1:len(payload) - payload[0]]


class FrameReader:
    """Bytes in, whole frames out; a partial frame waits for the rest. With `preface`, the
    stream must open with the client's connection preface (a client's side)."""

    def __init__(self, preface: bool) -> None:
        self._buf = bytearray()
        self._preface_left = len(PREFACE) if preface else 0

    def feed(self, data: bytes) -> tuple[bytes, list[Frame]]:
        """The preface bytes this call completed (to pass on as they are), and the frames."""
        self._buf += data
        preface = self._take_preface()
        frames, start, buf = [], 0, self._buf
        with memoryview(buf) as view:  # one copy per frame, out of the buffer
            while len(buf) - start >= HEADER_BYTES:
                length = int.from_bytes(view[start:start + 3], "big")
                end = start + HEADER_BYTES + length
                if len(buf) < end:
                    break
                kind, flags = buf[start + 3], buf[start + 4]
                stream = int.from_bytes(view[start + 5:start + 9], "big") & 0x7FFF_FFFF
                frames.append(Frame(kind, flags, stream, bytes(view[start:end])))
                start = end
        del buf[:start]
        return preface, frames

    def _take_preface(self) -> bytes:
        if not self._preface_left:
            return b""
        done = len(PREFACE) - self._preface_left
        n = min(self._preface_left, len(self._buf))
        got = bytes(self._buf[:n])
        if got != PREFACE[done:done + n]:
            raise FramingError("not an HTTP/2 connection (wrong client preface)")
        self._preface_left -= n
        del self._buf[:n]
        return got


def frame(kind: FrameType, flags: int, stream: int, payload: bytes) -> bytes:
    if len(payload) > MAX_FRAME_BYTES:
        raise ValueError(f"frame payload of {len(payload)} bytes")
    return (len(payload).to_bytes(3, "big") + bytes((kind, flags))
            + struct.pack(">I", stream & 0x7FFF_FFFF) + payload)


def rst_stream(stream: int, code: ErrorCode) -> bytes:
    return frame(FrameType.RST_STREAM, 0, stream, struct.pack(">I", code))


def window_update(stream: int, increment: int) -> bytes:
    if not 0 < increment < 1 << 31:
        raise ValueError(f"window increment {increment}")
    return frame(FrameType.WINDOW_UPDATE, 0, stream, struct.pack(">I", increment))


STATUS_200 = b"\x88"  # HPACK: static table entry 8, ":status: 200"


def _hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 0x80:
        out.append(0x80 | (value & 0x7F))
        value >>= 7
    out.append(value)
    return bytes(out)


def literal(name: str, value: str) -> bytes:
    """One header field as a literal without indexing, new name, no Huffman coding."""
    n, v = name.encode("ascii"), value.encode("ascii")
    return b"\x00" + _hpack_int(len(n), 7) + n + _hpack_int(len(v), 7) + v


def grpc_message_value(text: str) -> str:
    """`grpc-message` percent-encoding (gRPC's PROTOCOL-HTTP2): printable ASCII but '%'
    as is, everything else as %XX of its UTF-8 bytes."""
    return "".join(chr(b) if 0x20 <= b <= 0x7E and b != 0x25 else f"%{b:02X}"
                   for b in text.encode())


def grpc_error_headers(stream: int, status: int, message: str, *, trailers_only: bool) -> bytes:
    """A gRPC error as one HEADERS frame that ends the stream: "Trailers-Only" (with
    `:status` and content type) when the server has sent no headers on the stream yet,
    plain trailers after them."""
    block = (STATUS_200 + literal("content-type", "application/grpc")) if trailers_only else b""
    block += literal("grpc-status", str(status))
    block += literal("grpc-message", grpc_message_value(message))
    return frame(FrameType.HEADERS, Flag.END_STREAM | Flag.END_HEADERS, stream, block)
