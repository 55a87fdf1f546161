"""A `/metrics` endpoint on its own thread, bound to the address it is given (port 0 = any
free port; the bound one is read back), optionally over TLS (mTLS when the context requires
client certificates) and behind bearer tokens.

One thread accepts; each connection is served on a thread of its own, which also runs the TLS
handshake (with a timeout), so a client that connects and says nothing holds up nobody.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from pdserve.serving.security.http_auth import bearer_ok

log = logging.getLogger(__name__)
_CONNECTION_TIMEOUT_S = 10.0


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:  # a bad client is not news
        log.debug("metrics: connection from %s failed", client_address, exc_info=True)


class _Server6(_Server):
    address_family = socket.AF_INET6


def _handler(registry: CollectorRegistry, tokens: Sequence[str]) -> type:
    class Handler(BaseHTTPRequestHandler):
        timeout = _CONNECTION_TIMEOUT_S

        def setup(self) -> None:
            super().setup()
            if isinstance(self.connection, ssl.SSLSocket):
                self.connection.do_handshake()

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if self.path.split("?", 1)[0] not in ("/metrics", "/"):
                self.send_error(404)
                return
            if not bearer_ok(self.headers.get("Authorization"), tokens):
                self.send_response(401)
                self.send_header("WWW-Authenticate", "Bearer")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args) -> None:  # noqa: A002 - scrapes are not logged
            pass

    return Handler


class MetricsServer:
    def __init__(self, host: str, port: int, registry: CollectorRegistry,
                 ssl_context: ssl.SSLContext | None = None, tokens: Sequence[str] = ()
                 ) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"metrics port must be 0..65535, got {port}")
        server_class = _Server6 if ":" in host else _Server
        self._server = server_class((host.strip("[]"), port), _handler(registry, tuple(tokens)))
        if ssl_context is not None:
            self._server.socket = ssl_context.wrap_socket(
                self._server.socket, server_side=True, do_handshake_on_connect=False)
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="metrics-http", daemon=True)
        self._thread.start()
        bound = self._server.server_address[1]
        self.address = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"
        """host:port it serves on."""

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
