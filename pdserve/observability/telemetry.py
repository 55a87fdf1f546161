"""Everything a worker process exposes about itself, built once at start-up: its registry,
the engine collector, the request interceptor for its gRPC server and the `/metrics` server."""

from __future__ import annotations

import ssl
from collections.abc import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry

from pdserve.observability.http import MetricsServer
from pdserve.observability.worker_metrics import WorkerCollector, WorkerSnapshot
from pdserve.observability.worker_requests import RequestInterceptor, WorkerRequestMetrics


class WorkerTelemetry:
    def __init__(self, component: str, worker_id: str, snapshot: Callable[[], WorkerSnapshot],
                 host: str, metrics_port: int, methods: Iterable[str],
                 ssl_context: ssl.SSLContext | None = None, tokens: Sequence[str] = ()
                 ) -> None:
        """`metrics_port`: 0 = any free port, -1 = no `/metrics` server; `ssl_context` and
        `tokens` (bearer) secure it."""
        if metrics_port < -1:
            raise ValueError(f"metrics_port must be -1 (off), 0 (any) or a port, "
                             f"got {metrics_port}")
        self.registry = CollectorRegistry()
        self.registry.register(WorkerCollector(component, worker_id, snapshot))
        self.requests = WorkerRequestMetrics(self.registry, component, worker_id)
        self.interceptor = RequestInterceptor(self.requests, methods)
        self.server = (None if metrics_port == -1
                       else MetricsServer(host, metrics_port, self.registry, ssl_context,
                                          tokens))

    def ready_info(self) -> dict[str, str]:
        """Fields for the `PDSERVE_READY` line."""
        return {"metrics_address": self.server.address} if self.server is not None else {}

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
