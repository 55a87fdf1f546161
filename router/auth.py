"""Bearer-token authentication for the public API (health and reflection stay open)."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from pdserve.serving.security.http_auth import bearer_ok
from pdserve.serving.security.rpc_auth import OPEN_PREFIXES, deny


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, tokens: Sequence[str]) -> None:
        self._tokens = tuple(tokens)

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if not self._tokens or method.startswith(OPEN_PREFIXES):
            return await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        if bearer_ok(metadata.get("authorization", ""), self._tokens):
            return await continuation(handler_call_details)
        return deny(await continuation(handler_call_details), grpc.StatusCode.UNAUTHENTICATED,
                    "missing or invalid bearer token")
