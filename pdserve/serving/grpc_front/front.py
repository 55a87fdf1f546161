"""The gRPC front's sockets: it listens on the public address (TLS ends here when it is on)
and gives each client connection its own connection to the gRPC server, which listens on a
Unix socket in a directory only this user can open. `guard.GuardedConnection` decides what
passes; this module only moves bytes, on the caller's event loop.

    client ──TCP/TLS──► GrpcFront ──Unix socket──► grpc.aio server (same process)

Backpressure is end to end: a pump reads from one side only when the other side has taken
what it wrote before (`drain`). Either side closing closes both.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import ssl
import tempfile

from pdserve.serving.grpc_front.frames import FramingError
from pdserve.serving.grpc_front.guard import GuardedConnection, Output

log = logging.getLogger(__name__)

READ_BYTES = 1 << 16  # per loop turn: bounds the work one read can hand the event loop


class BackendSocket:
    """A Unix socket path for the gRPC server, in a fresh directory of mode 0700."""

    def __init__(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="pdserve-grpc-")
        self.path = os.path.join(self.directory, "grpc.sock")

    @property
    def grpc_address(self) -> str:
        return f"unix:{self.path}"

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


class GrpcFront:
    def __init__(self, backend_path: str, max_message_bytes: int,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self._backend_path = backend_path
        self._limit = max_message_bytes
        self._ssl = ssl_context
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task] = set()
        self._guards: set[GuardedConnection] = set()
        self._closed_refusals = 0

    @property
    def refusals(self) -> int:
        """Messages refused from their length prefix, over all connections."""
        return self._closed_refusals + sum(g.refusals for g in self._guards)

    async def start(self, host: str, port: int) -> int:
        """Listen on exactly `host:port` (0 = a free port, the same one on every address
        `host` names); the bound port."""
        self._server = await asyncio.start_server(self._accept, host, port, ssl=self._ssl,
                                                  reuse_port=False)
        ports = {s.getsockname()[1] for s in self._server.sockets}
        if port == 0 and len(ports) > 1:  # "localhost": both families on one port
            self._server.close()
            first = self._server.sockets[0].getsockname()[1]
            self._server = await asyncio.start_server(self._accept, host, first,
                                                      ssl=self._ssl, reuse_port=False)
        return self._server.sockets[0].getsockname()[1]

    def stop_listening(self) -> None:
        if self._server is not None:
            self._server.close()

    async def close(self) -> None:
        """Stop listening and end every connection."""
        self.stop_listening()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._connections.add(task)
        try:
            await self._relay(reader, writer)
        except asyncio.CancelledError:
            pass  # close() ends it: the task is ours, and asyncio would log it as an error
        finally:
            self._connections.discard(task)
            writer.close()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            b_reader, b_writer = await asyncio.open_unix_connection(self._backend_path)
        except OSError as exc:
            log.warning("gRPC front: the gRPC server's socket does not answer: %s", exc)
            return
        conn = GuardedConnection(self._limit)
        self._guards.add(conn)
        pumps = {asyncio.create_task(self._pump(reader, conn.from_client, b_writer, writer)),
                 asyncio.create_task(self._pump(b_reader, conn.from_backend, b_writer, writer))}
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            self._guards.discard(conn)
            self._closed_refusals += conn.refusals
            b_writer.close()

    @staticmethod
    async def _pump(reader: asyncio.StreamReader, feed, to_backend: asyncio.StreamWriter,
                    to_client: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(READ_BYTES):
                out: Output = feed(data)
                for writer, chunk in ((to_backend, out.to_backend), (to_client, out.to_client)):
                    if chunk:
                        writer.write(chunk)
                        await writer.drain()
        except FramingError as exc:
            log.info("gRPC front: dropping a connection: %s", exc)
        except (ConnectionError, ssl.SSLError, OSError) as exc:
            log.debug("gRPC front: connection ended: %s", exc)


def tls_context(base: ssl.SSLContext) -> ssl.SSLContext:
    """gRPC over TLS needs HTTP/2 chosen by ALPN (grpc-core clients insist on it)."""
    base.set_alpn_protocols(["h2"])
    return base


__all__ = ["BackendSocket", "GrpcFront", "tls_context"]
