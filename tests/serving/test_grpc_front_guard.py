"""The gRPC front's connection guard, frame by frame: what passes untouched, what a refusal
sends each side, flow-control credit for what it drops, and header blocks left whole."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.serving.grpc_front.frames import (
    PREFACE,
    ErrorCode,
    Flag,
    FrameReader,
    FrameType,
    FramingError,
    frame,
    rst_stream,
    window_update,
)
from pdserve.serving.grpc_front.guard import GuardedConnection

LIMIT = 1000
SETTINGS = frame(FrameType.SETTINGS, 0, 0, b"")
HEADERS = b"\x82\x86\x84"  # an opaque header block: the guard never decodes one


def message(n: int, fill: bytes = b"m") -> bytes:
    return struct.pack(">BI", 0, n) + fill * n


def data(stream: int, payload: bytes, flags: int = 0) -> bytes:
    return frame(FrameType.DATA, flags, stream, payload)


def headers(stream: int, flags: int = Flag.END_HEADERS) -> bytes:
    return frame(FrameType.HEADERS, flags, stream, HEADERS)


def frames_of(raw: bytes) -> list[tuple[int, int, int, bytes]]:
    _, frames = FrameReader(preface=False).feed(raw)
    return [(f.type, f.flags, f.stream, bytes(f.payload)) for f in frames]


def opened(limit: int = LIMIT) -> GuardedConnection:
    conn = GuardedConnection(limit)
    out = conn.from_client(PREFACE + SETTINGS)
    assert out.to_backend == PREFACE + SETTINGS and out.to_client == b""
    return conn


def test_a_stream_under_the_limit_passes_byte_for_byte_both_ways():
    conn = opened()
    client = headers(1) + data(1, message(LIMIT)) + data(1, message(3), Flag.END_STREAM)
    assert conn.from_client(client).to_backend == client
    server = headers(1) + data(1, message(7)) + headers(1, Flag.END_HEADERS | Flag.END_STREAM)
    out = conn.from_backend(server)
    assert out.to_client == server and out.to_backend == b""
    assert conn.refusals == 0


def test_an_oversized_message_is_refused_from_its_prefix_alone():
    conn = opened()
    conn.from_client(headers(3))
    first = data(3, message(LIMIT + 1)[:20])  # the prefix and a little of the body
    out = conn.from_client(first)
    assert frames_of(out.to_backend) == [(FrameType.RST_STREAM, 0, 3,
                                          struct.pack(">I", ErrorCode.CANCEL))]
    to_client = frames_of(out.to_client)
    kinds = [(kind, stream) for kind, _, stream, _ in to_client]
    assert kinds == [(FrameType.HEADERS, 3), (FrameType.RST_STREAM, 3),
                     (FrameType.WINDOW_UPDATE, 0)]
    _, flags, _, block = to_client[0]
    assert flags == Flag.END_STREAM | Flag.END_HEADERS
    assert block.startswith(b"\x88")  # Trailers-Only: ":status: 200" first
    assert b"grpc-status\x018" in block and b"1001 vs. 1000" in block
    assert to_client[2][3] == struct.pack(">I", len(first) - 9)  # the dropped DATA, credited
    assert conn.refusals == 1


def test_what_is_still_in_flight_on_a_refused_stream_is_dropped_and_credited():
    conn = opened()
    conn.from_client(headers(5) + data(5, message(5000)[:100]))
    rest = data(5, b"x" * 300) + data(5, b"y" * 40, Flag.END_STREAM)
    out = conn.from_client(rest + headers(7))
    assert out.to_backend == headers(7)  # the next stream is untouched
    assert frames_of(out.to_client) == [(FrameType.WINDOW_UPDATE, 0, 0,
                                         struct.pack(">I", 340))]
    # The server's own frames for it are dropped too, its DATA credited back to the server.
    out = conn.from_backend(data(5, b"z" * 50) + rst_stream(5, ErrorCode.CANCEL))
    assert out.to_client == b""
    assert out.to_backend == window_update(0, 50)


def test_header_blocks_always_pass_they_carry_the_shared_hpack_state():
    conn = opened()
    conn.from_client(headers(1) + data(1, message(LIMIT * 2)[:10]))
    trailers = headers(1, Flag.END_HEADERS | Flag.END_STREAM)
    assert conn.from_client(trailers).to_backend == trailers
    assert conn.from_backend(headers(1)).to_client == headers(1)


def test_the_fronts_frames_wait_for_an_open_header_block_to_close():
    conn = opened()
    conn.from_client(headers(1) + headers(3))
    open_block = headers(1, 0)  # HEADERS without END_HEADERS: CONTINUATION must follow
    assert conn.from_backend(open_block).to_client == open_block
    out = conn.from_client(data(3, message(LIMIT + 5)[:9]))
    assert out.to_client == b""  # held: nothing may come between HEADERS and CONTINUATION
    cont = frame(FrameType.CONTINUATION, Flag.END_HEADERS, 1, b"\x88")
    released = frames_of(conn.from_backend(cont).to_client)
    assert [(kind, stream) for kind, _, stream, _ in released] == [
        (FrameType.CONTINUATION, 1), (FrameType.HEADERS, 3), (FrameType.RST_STREAM, 3),
        (FrameType.WINDOW_UPDATE, 0)]


def test_after_response_headers_the_refusal_is_plain_trailers():
    conn = opened()
    conn.from_client(headers(1) + data(1, message(10)))
    conn.from_backend(headers(1) + data(1, message(2)))  # the server answered: streaming
    out = conn.from_client(data(1, message(LIMIT + 1)[:5]))
    block = frames_of(out.to_client)[0][3]
    assert not block.startswith(b"\x88") and b"content-type" not in block
    assert b"grpc-status\x018" in block


def test_message_boundaries_are_followed_across_frames_and_padding():
    conn = opened()
    conn.from_client(headers(1))
    stream = message(LIMIT) + message(LIMIT) + message(LIMIT + 1)[:5]
    cut = [0, 1, 3, 700, 1004, 1005, 1006, 2009, 2010, 2012, len(stream)]
    out = b""
    for a, b in zip(cut, cut[1:], strict=False):
        padded = bytes((4,)) + stream[a:b] + b"\0" * 4
        out += conn.from_client(data(1, padded, Flag.PADDED)).to_client
    assert conn.refusals == 1  # the third message, whose prefix was split over two frames
    assert b"1001 vs. 1000" in out


def test_a_refusal_ends_only_its_own_stream():
    conn = opened()
    conn.from_client(headers(1) + headers(3))
    conn.from_client(data(3, message(LIMIT + 1)[:5]))
    ok = data(1, message(4), Flag.END_STREAM)
    assert conn.from_client(ok).to_backend == ok
    answer = headers(1) + data(1, message(1)) + headers(1, Flag.END_HEADERS | Flag.END_STREAM)
    assert conn.from_backend(answer).to_client == answer


def test_bytes_that_are_not_http2_are_refused():
    conn = GuardedConnection(LIMIT)
    with pytest.raises(FramingError):
        conn.from_client(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    conn = opened()
    conn.from_client(headers(1))
    with pytest.raises(FramingError):  # padding longer than the frame
        conn.from_client(data(1, bytes((9,)) + b"ab", Flag.PADDED))


def _client_bytes() -> bytes:
    return (PREFACE + SETTINGS + headers(1) + data(1, message(LIMIT)) + headers(3)
            + data(3, message(LIMIT + 1)[:300]) + data(3, b"q" * 200)
            + data(1, message(9), Flag.END_STREAM) + frame(FrameType.PING, 0, 0, b"p" * 8))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 400), max_size=30))
def test_any_split_of_the_bytes_gives_the_same_output(sizes):
    whole = GuardedConnection(LIMIT).from_client(_client_bytes())
    conn, raw, got_backend, got_client = GuardedConnection(LIMIT), _client_bytes(), b"", b""
    for size in [*sizes, len(raw)]:
        piece, raw = raw[:size], raw[size:]
        out = conn.from_client(piece)
        got_backend += out.to_backend
        got_client += out.to_client
    assert got_backend == whole.to_backend
    assert frames_of(got_client)[:2] == frames_of(whole.to_client)[:2]  # the refusal
    credit = sum(struct.unpack(">I", p)[0] for kind, _, _, p in frames_of(got_client)
                 if kind == FrameType.WINDOW_UPDATE)
    assert credit == (300 + 200)  # every dropped DATA byte, however the bytes were split
