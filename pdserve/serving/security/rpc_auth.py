"""Authentication of internal RPCs (the workers' `pdserve.worker.v1.Worker` service).

A caller proves it belongs to the cluster in one of two ways:

- a client certificate from the cluster CA: the server requires one (mTLS, `--tls-ca`), so
  the TLS handshake itself refuses everyone else and no call ever reaches a handler;
- the cluster secret: every call carries `pdserve-cluster-auth: v1.<unix time>.<mac>`, the
  HMAC-SHA256 under the secret's RPC key of `v1|<unix time>|<full method name>`. The secret
  itself never travels; a credential is good for one method and `MAX_SKEW_S` seconds around
  the time it names (a captured one cannot be turned into another call).

`grpc.health.v1` and server reflection stay open (probes, grpcurl); every other method of a
server with a secret answers UNAUTHENTICATED to a call without a valid credential.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable

import grpc

METADATA_KEY = "pdserve-cluster-auth"
VERSION = "v1"
MAX_SKEW_S = 300
"""How far the time in a credential may be from the server's clock."""
OPEN_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")


def _method_name(method: str | bytes) -> str:
    return method.decode() if isinstance(method, bytes) else method


def _mac(key: bytes, stamp: int, method: str) -> str:
    return hmac.new(key, f"{VERSION}|{stamp}|{method}".encode(), hashlib.sha256).hexdigest()


def make_credential(key: bytes, method: str | bytes, now: float | None = None) -> str:
    stamp = int(time.time() if now is None else now)
    return f"{VERSION}.{stamp}.{_mac(key, stamp, _method_name(method))}"


def check_credential(key: bytes, method: str, credential: str,
                     now: float | None = None) -> str:
    """"" if `credential` is valid for `method` now, else why not (for the status message)."""
    if not credential:
        return f"missing cluster credential ({METADATA_KEY} metadata)"
    version, _, rest = credential.partition(".")
    stamp_text, _, mac = rest.partition(".")
    if version != VERSION or not stamp_text.isdigit() or not mac:
        return "malformed cluster credential"
    stamp = int(stamp_text)
    if not hmac.compare_digest(mac.encode(), _mac(key, stamp, method).encode()):
        return "invalid cluster credential"
    if abs((time.time() if now is None else now) - stamp) > MAX_SKEW_S:
        return f"expired cluster credential (clocks more than {MAX_SKEW_S}s apart?)"
    return ""


def deny(handler: grpc.RpcMethodHandler | None, code: grpc.StatusCode, message: str
         ) -> grpc.RpcMethodHandler | None:
    """A handler of the same shape as `handler` that only ends the call with `code`."""
    if handler is None:
        return None

    async def unary(request, context):
        await context.abort(code, message)

    async def stream(request, context):
        await context.abort(code, message)
        yield  # pragma: no cover - makes this an async generator

    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(
            stream, handler.request_deserializer, handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(
        unary, handler.request_deserializer, handler.response_serializer)


class ClusterAuthInterceptor(grpc.aio.ServerInterceptor):
    """Server side: every method but health and reflection needs a valid credential."""

    def __init__(self, key: bytes, clock: Callable[[], float] = time.time) -> None:
        self._key = key
        self._clock = clock

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(OPEN_PREFIXES):
            return await continuation(handler_call_details)
        given = ""
        for k, v in handler_call_details.invocation_metadata or ():
            if k == METADATA_KEY:
                given = v if isinstance(v, str) else v.decode(errors="replace")
        reason = check_credential(self._key, method, given, self._clock())
        if not reason:
            return await continuation(handler_call_details)
        return deny(await continuation(handler_call_details),
                    grpc.StatusCode.UNAUTHENTICATED, reason)


def _with_credential(key: bytes, d: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*(d.metadata or ()),
                                 (METADATA_KEY, make_credential(key, d.method)))
    return d._replace(metadata=metadata)


# grpc.aio files each interceptor under one call kind only: one class per kind.
class _AioUnaryCredential(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, key: bytes) -> None:
        self._key = key

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_with_credential(self._key, client_call_details), request)


class _AioStreamCredential(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, key: bytes) -> None:
        self._key = key

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_with_credential(self._key, client_call_details), request)


class _Details(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready = credentials, wait_for_ready
        self.compression = compression


class _SyncCredential(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Client side (blocking channels): adds a fresh credential to every call."""

    def __init__(self, key: bytes) -> None:
        self._key = key

    def _details(self, d: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = [*(d.metadata or ()), (METADATA_KEY, make_credential(self._key, d.method))]
        return _Details(d.method, d.timeout, metadata, d.credentials,
                        getattr(d, "wait_for_ready", None), getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)


def aio_client_interceptors(key: bytes) -> list[grpc.aio.ClientInterceptor]:
    """Client side (grpc.aio): a fresh credential on every unary and server-streaming call."""
    return [_AioUnaryCredential(key), _AioStreamCredential(key)]


def sync_client_interceptor(key: bytes) -> grpc.UnaryUnaryClientInterceptor:
    return _SyncCredential(key)
