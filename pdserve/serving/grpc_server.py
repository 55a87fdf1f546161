"""Starting a grpc.aio server the same way everywhere: health, reflection, binding, TLS."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.serving.grpc_front import BackendSocket, GrpcFront, tls_context
from pdserve.serving.security.tls import TLSConfig

MAX_MESSAGE_BYTES = 64 * 2**20
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),  # a busy port must fail loudly, not be shared
    # Clients ping every 30 s during long silent calls (a big prefill); accept that.
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
]


@dataclass
class RunningServer:
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    services: tuple[str, ...] = ()
    """Full names of the services registered (each answers health checks by its name)."""
    front: GrpcFront | None = None
    """The front that owns the public port, when there is one (`start_server(front=True)`)."""
    backend_socket: BackendSocket | None = None

    async def stop(self, grace: float | None) -> None:
        """Stop taking connections, let calls finish within `grace` seconds, end the rest."""
        if self.front is not None:
            self.front.stop_listening()
        await self.server.stop(grace)
        if self.front is not None:
            await self.front.close()
        if self.backend_socket is not None:
            self.backend_socket.remove()

    async def set_serving(self, serving: bool) -> None:
        """The server's status, and every service's: a check for "" or for any registered
        service name (e.g. "pdserve.v1.PDServe") answers it."""
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", *self.services):
            await self.health.set(name, status)


async def start_server(host: str, port: int, register: Callable[[grpc.aio.Server], None],
                       service_names: Sequence[str], tls: TLSConfig | None = None,
                       interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                       max_receive_bytes: int = MAX_MESSAGE_BYTES,
                       front: bool = False) -> RunningServer:
    """Bind exactly `host:port` (0 = a free port), register services, start serving.
    Messages over `max_receive_bytes` are refused by gRPC before they are read; with `front`,
    by the `grpc_front` that owns the port, from their length prefix (grpc-core's own
    refusal comes ~100 ms later), and TLS ends in the front."""
    options = [(k, max_receive_bytes if k == "grpc.max_receive_message_length" else v)
               for k, v in SERVER_OPTIONS]
    server = grpc.aio.server(options=options, interceptors=list(interceptors))
    register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    backend = BackendSocket() if front else None
    if backend is not None:
        bound = server.add_insecure_port(backend.grpc_address)
    elif tls is None:
        bound = server.add_insecure_port(address)
    else:
        bound = server.add_secure_port(address, tls.grpc_credentials())
    if bound == 0:
        raise OSError(f"cannot bind gRPC server to {backend.path if backend else address}")
    await server.start()
    public = None
    if backend is not None:
        public = GrpcFront(backend.path, max_receive_bytes,
                           tls_context(tls.ssl_context()) if tls is not None else None)
        try:
            bound = await public.start(host, port)
        except OSError as exc:
            await server.stop(None)
            backend.remove()
            raise OSError(f"cannot bind gRPC server to {address}: {exc.strerror}") from None
    running = RunningServer(server, bound, health_servicer, tuple(service_names), public,
                            backend)
    await running.set_serving(True)
    return running


__all__ = ["MAX_MESSAGE_BYTES", "SERVER_OPTIONS", "RunningServer", "TLSConfig", "start_server"]
