"""A front for a public gRPC server: it refuses a message over the limit from its length
prefix, before the server reads a byte of it, and passes everything else on unchanged
(`guard` decides, `front` moves the bytes, `frames` is the HTTP/2 framing it needs)."""

from pdserve.serving.grpc_front.front import BackendSocket, GrpcFront, tls_context
from pdserve.serving.grpc_front.guard import GuardedConnection, Output

__all__ = ["BackendSocket", "GrpcFront", "GuardedConnection", "Output", "tls_context"]
