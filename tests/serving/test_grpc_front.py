"""The gRPC front with real grpcio on both sides: calls of every shape pass through it as
without it (plaintext and TLS), an oversized message is RESOURCE_EXHAUSTED from its prefix, and
the connection it was refused on goes on working (its flow-control window was credited)."""

from __future__ import annotations

import asyncio
import os

import grpc
import pytest

from pdserve.serving.grpc_server import start_server
from pdserve.serving.security.certs import ThrowawayCA
from pdserve.serving.security.tls import TLSConfig

pytestmark = pytest.mark.timeout(120)

LIMIT = 64 * 1024
SERVICE = "test.Echo"


async def _unary(request: bytes, context) -> bytes:
    return request[::-1]


async def _stream_out(request: bytes, context):
    for i in range(int(request)):
        yield str(i).encode() * 1000


async def _stream_both(requests, context):
    async for request in requests:
        yield request


def _register(server: grpc.aio.Server) -> None:
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
        "Unary": grpc.unary_unary_rpc_method_handler(_unary),
        "StreamOut": grpc.unary_stream_rpc_method_handler(_stream_out),
        "StreamBoth": grpc.stream_stream_rpc_method_handler(_stream_both),
    }),))


async def _serve(front: bool, tls: TLSConfig | None = None):
    return await start_server("127.0.0.1", 0, _register, [SERVICE], tls=tls,
                              max_receive_bytes=LIMIT, front=front)


def _channel(port: int, creds: grpc.ChannelCredentials | None = None) -> grpc.aio.Channel:
    opts = [("grpc.max_send_message_length", 64 << 20)]
    if creds is None:
        return grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=opts)
    return grpc.aio.secure_channel(f"127.0.0.1:{port}", creds, options=opts)


async def _every_shape(channel: grpc.aio.Channel) -> list:
    unary = channel.unary_unary(f"/{SERVICE}/Unary")
    out = [await unary(b"abc"), await unary(b"x" * (LIMIT - 5))]  # the largest message allowed
    out.append([m async for m in channel.unary_stream(f"/{SERVICE}/StreamOut")(b"300")])
    both = channel.stream_stream(f"/{SERVICE}/StreamBoth")
    out.append([m async for m in both(iter([b"a" * 5000] * 40))])
    calls = [unary(str(i).encode()) for i in range(50)]  # many streams at once
    out.append(await asyncio.gather(*calls))
    return out


@pytest.mark.parametrize("shape", ["plaintext", "tls"])
def test_every_call_shape_passes_as_without_the_front(shape, tmp_path):
    tls = creds = None
    if shape == "tls":
        ca = ThrowawayCA(tmp_path / "ca")
        issued = ca.issue("router")
        tls = TLSConfig.from_files(issued.cert, issued.key)
        creds = grpc.ssl_channel_credentials(open(ca.ca_path, "rb").read())

    async def main() -> None:
        results = []
        for front in (False, True):
            server = await _serve(front, tls)
            try:
                async with _channel(server.port, creds) as channel:
                    results.append(await _every_shape(channel))
            finally:
                await server.stop(None)
        assert results[0] == results[1]

    asyncio.run(main())


def test_an_oversized_message_is_refused_and_its_connection_goes_on():
    async def main() -> None:
        server = await _serve(front=True)
        try:
            async with _channel(server.port) as channel:
                unary = channel.unary_unary(f"/{SERVICE}/Unary")
                # Far more refused bytes than any flow-control window: without the front's
                # WINDOW_UPDATE credit the connection would stall.
                for size in [LIMIT + 1, 1 << 20, 8 << 20] * 4:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await unary(b"y" * size, timeout=30)
                    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert f"({size} vs. {LIMIT})" in err.value.details()
                assert await unary(b"still here", timeout=30) == b"ereh llits"
                both = channel.stream_stream(f"/{SERVICE}/StreamBoth")
                call = both(iter([b"ok"] * 3 + [b"z" * (LIMIT + 1)]), timeout=30)
                got = []
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for m in call:
                        got.append(m)
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert got == [b"ok"] * len(got)  # what it echoed before is intact
                assert await unary(b"1") == b"1"
            assert server.front.refusals == 13
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_the_backend_socket_is_private_and_removed_at_stop():
    async def main() -> str:
        server = await _serve(front=True)
        directory = server.backend_socket.directory
        assert os.stat(directory).st_mode & 0o777 == 0o700
        await server.stop(None)
        return directory

    assert not os.path.exists(asyncio.run(main()))


def test_a_busy_port_fails_loudly():
    async def main() -> None:
        first = await _serve(front=True)
        try:
            with pytest.raises(OSError, match="cannot bind"):
                await start_server("127.0.0.1", first.port, _register, [SERVICE], front=True)
        finally:
            await first.stop(None)

    asyncio.run(main())


def test_the_router_serves_through_the_front_unless_told_not_to():
    from router.__main__ import parse

    assert parse(["--model", "m", "--decode", "h:1"])[0].grpc_front
    assert not parse(["--model", "m", "--decode", "h:1", "--no-grpc-front"])[0].grpc_front
