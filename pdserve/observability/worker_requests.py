"""Logs and counts a worker's request RPCs (Prefill, Decode) from a gRPC server interceptor,
so the services keep their own logic: every call logs its admission and its end with the
router's request id (`request.request_id`), and ends up in `pdserve_worker_requests_total`
(and, unless OK or CANCELLED, `pdserve_worker_errors_total`) by gRPC status.

A router cancels a decode call once it has what it needs (a stop string), so CANCELLED is a
normal end, not an error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge

from pdserve.observability.logs import request_log

log = logging.getLogger("pdserve.requests")
_NOT_ERRORS = frozenset({"OK", "CANCELLED"})


class WorkerRequestMetrics:
    def __init__(self, registry: CollectorRegistry, component: str, worker_id: str) -> None:
        labels = ("component", "worker")
        self.ids = (component, worker_id)
        self.requests = Counter("pdserve_worker_requests", "Request RPCs by final status.",
                                [*labels, "rpc", "status"], registry=registry)
        self.errors = Counter("pdserve_worker_errors", "Request RPCs that failed, by status.",
                              [*labels, "status"], registry=registry)
        self.inflight = Gauge("pdserve_worker_requests_inflight", "Request RPCs open now.",
                              labels, registry=registry).labels(*self.ids)

    def finished(self, rpc: str, status: str) -> None:
        self.requests.labels(*self.ids, rpc, status).inc()
        if status not in _NOT_ERRORS:
            self.errors.labels(*self.ids, status).inc()


class RequestInterceptor(grpc.aio.ServerInterceptor):
    """Wraps the handlers of `methods` (short names, e.g. "Prefill")."""

    def __init__(self, metrics: WorkerRequestMetrics, methods: Iterable[str]) -> None:
        self.metrics = metrics
        self.methods = frozenset(methods)

    async def intercept_service(self, continuation: Callable[..., Awaitable],
                                details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        rpc = details.method.rsplit("/", 1)[-1]
        if handler is None or rpc not in self.methods:
            return handler
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(rpc, handler.unary_unary), handler.request_deserializer,
                handler.response_serializer)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._stream(rpc, handler.unary_stream), handler.request_deserializer,
                handler.response_serializer)
        return handler

    def _unary(self, rpc: str, behavior):
        async def wrapped(request, context):
            call = _Call(self.metrics, rpc, request)
            try:
                response = await behavior(request, context)
            except BaseException as exc:
                call.end(_status(exc, context))
                raise
            call.end("OK")
            return response
        return wrapped

    def _stream(self, rpc: str, behavior):
        async def wrapped(request, context):
            call = _Call(self.metrics, rpc, request)
            try:
                async for message in behavior(request, context):
                    call.tokens += len(getattr(getattr(message, "tokens", None), "token_ids",
                                               ()))
                    yield message
            except BaseException as exc:
                call.end(_status(exc, context))
                raise
            call.end("OK")
        return wrapped


class _Call:
    """One request RPC: logs its admission now and its end once."""

    def __init__(self, metrics: WorkerRequestMetrics, rpc: str, request) -> None:
        self.metrics = metrics
        self.rpc = rpc
        self.tokens = 0
        self.start = time.perf_counter()
        rid = str(getattr(request, "request_id", ""))
        self.log = request_log(log, rid, rpc=rpc)
        prompt = len(getattr(request, "prompt_token_ids", ()))
        metrics.inflight.inc()
        self.log.info("request %s admitted (%s): %d prompt tokens", rid, rpc, prompt,
                      extra={"event": "request_start", "prompt_tokens": prompt})

    def end(self, status: str) -> None:
        self.metrics.inflight.dec()
        self.metrics.finished(self.rpc, status)
        took = round(time.perf_counter() - self.start, 6)
        self.log.info("request %s finished (%s): status=%s tokens=%d in %.3fs",
                      self.log.extra["request_id"], self.rpc, status, self.tokens, took,
                      extra={"event": "request_finish", "status": status,
                             "tokens": self.tokens, "duration_s": took})


def _status(exc: BaseException, context) -> str:
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        return grpc.StatusCode.CANCELLED.name
    code = context.code()  # set by context.abort(...)
    if isinstance(code, grpc.StatusCode) and code is not grpc.StatusCode.OK:
        return code.name
    return grpc.StatusCode.UNKNOWN.name
