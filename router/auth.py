"""Bearer-token authentication for the public API (health and reflection stay open)."""

from __future__ import annotations

import hmac
from collections.abc import Sequence

import grpc

_OPEN_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, tokens: Sequence[str]) -> None:
        self._tokens = [t.encode() for t in tokens]

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if not self._tokens or method.startswith(_OPEN_PREFIXES):
            return await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        header = metadata.get("authorization", "")
        token = header[7:].encode() if header.lower().startswith("bearer ") else b""
        if any(hmac.compare_digest(token, t) for t in self._tokens):
            return await continuation(handler_call_details)
        return _deny(await continuation(handler_call_details))


def _deny(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler | None:
    if handler is None:
        return None

    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")

    async def stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")
        yield  # pragma: no cover - makes this an async generator

    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(
            stream, handler.request_deserializer, handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(
        unary, handler.request_deserializer, handler.response_serializer)
