"""A worker's `/metrics` endpoint: prometheus_client's HTTP server on its own thread, bound to
the address it is given (port 0 = any free port; the bound one is read back)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server


class MetricsServer:
    def __init__(self, host: str, port: int, registry: CollectorRegistry) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"metrics port must be 0..65535, got {port}")
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        bound = self._server.server_port
        self.address = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"
        """host:port it serves on."""

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
