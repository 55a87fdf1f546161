"""A worker's drain on SIGTERM: it finishes what it holds and keeps answering polls meanwhile.

    SERVING ──SIGTERM──► NOTICE ──notice_s──► REFUSING ──nothing open, background idle──► STOPPED
                          │  (with a registry     │        (or the drain timeout: what is still
                          │   link only)          │         open is cut, routers migrate it)
                          ▼                       ▼
      stats say `draining`, health NOT_SERVING;   new work (Decode, Prefill, PushKV, Prefetch)
      the worker left the registry, still takes   refused: UNAVAILABLE + `pdserve-draining`;
      work routers send before they see that      GetStats, GetInfo, Abort answered throughout

The router reads `WorkerStats.draining` from its polls: it sends the worker nothing new, keeps
it in its pool (the streams on it finish there, no migration), and treats a refusal tagged
`pdserve-draining` as "place this elsewhere", not as a dead worker. Only once the worker is
idle (or the timeout is over) does its gRPC server stop; then polls fail as for any exit.

`DrainGate` is the server interceptor that counts the work calls open and refuses new ones;
`drain` walks the states above.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

if TYPE_CHECKING:
    from pdserve.serving.grpc_server import RunningServer
    from pdserve.serving.index_link import IndexLink
    from pdserve.serving.worker_options import WorkerOptions

log = logging.getLogger(__name__)

DRAINING_METADATA_KEY = "pdserve-draining"
"""Trailing metadata of a call refused because the worker drains (value "1")."""
WORK_METHODS = frozenset({"Decode", "Prefill", "PushKV", "Prefetch"})
"""Worker RPCs that take on new work; every other one (polls, Abort) is answered while draining."""
LAST_CALLS_S = 1.0
"""Once idle: how long the server's stop lets calls still open (a poll) finish."""


class DrainState(enum.Enum):
    SERVING = "serving"
    NOTICE = "notice"  # stats say draining; work still taken
    REFUSING = "refusing"  # new work refused; what is open finishes
    STOPPED = "stopped"  # the server is stopping


_NEXT = {DrainState.SERVING: DrainState.NOTICE, DrainState.NOTICE: DrainState.REFUSING,
         DrainState.REFUSING: DrainState.STOPPED}


def is_draining_refusal(exc: grpc.aio.AioRpcError) -> bool:
    """Whether a failed worker call was refused because the worker drains (not a fault)."""
    if exc.code() is not grpc.StatusCode.UNAVAILABLE:
        return False
    return any(k == DRAINING_METADATA_KEY for k, _ in (exc.trailing_metadata() or ()))


class DrainGate(grpc.aio.ServerInterceptor):
    """Counts the work calls open (`WORK_METHODS`) and, once refusing, turns new ones away."""

    def __init__(self) -> None:
        self.state = DrainState.SERVING
        self.open = 0

    @property
    def draining(self) -> bool:
        """What the worker's stats report: true from the SIGTERM on."""
        return self.state is not DrainState.SERVING

    def advance(self, to: DrainState) -> None:
        """Move on to `to` (states only go forward; NOTICE may be skipped)."""
        state = self.state
        while state is not to:
            if state not in _NEXT:
                raise ValueError(f"drain cannot go from {self.state.value} to {to.value}")
            state = _NEXT[state]
        self.state = to

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        rpc = details.method.rsplit("/", 1)[-1]
        if handler is None or rpc not in WORK_METHODS:
            return handler
        refuse = self.state in (DrainState.REFUSING, DrainState.STOPPED)
        if handler.unary_unary is not None:
            behavior = _refuse_unary if refuse else self._count_unary(handler.unary_unary)
            return grpc.unary_unary_rpc_method_handler(
                behavior, handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream is not None:
            behavior = _refuse_stream if refuse else self._count_stream(handler.unary_stream)
            return grpc.unary_stream_rpc_method_handler(
                behavior, handler.request_deserializer, handler.response_serializer)
        return handler

    def _count_unary(self, behavior):
        async def wrapped(request, context):
            self.open += 1
            try:
                return await behavior(request, context)
            finally:
                self.open -= 1
        return wrapped

    def _count_stream(self, behavior):
        async def wrapped(request, context):
            self.open += 1
            try:
                async for message in behavior(request, context):
                    yield message
            finally:
                self.open -= 1
        return wrapped


_REFUSAL = ("worker is draining (shutting down): send new work elsewhere",
            ((DRAINING_METADATA_KEY, "1"),))


async def _refuse_unary(request, context):
    await context.abort(grpc.StatusCode.UNAVAILABLE, _REFUSAL[0], _REFUSAL[1])


async def _refuse_stream(request, context):
    await context.abort(grpc.StatusCode.UNAVAILABLE, _REFUSAL[0], _REFUSAL[1])
    yield  # pragma: no cover - abort raises; this makes the function a generator


@dataclass(frozen=True)
class DrainConfig:
    """How a worker stops on SIGTERM without failing the requests it has taken."""

    notice_s: float = 2.0
    """With a registry link: how long the worker still takes new requests after leaving the
    registry, so routers in discovery mode (reconciling every second) stop picking it first."""
    grace_s: float = 30.0
    """Longest wait for calls in flight and background work (KV transfers) to finish; what is
    left then is cut (`--drain-timeout`)."""
    poll_s: float = 0.05
    """How often the drain checks whether the worker is idle."""

    @classmethod
    def of(cls, options: WorkerOptions) -> DrainConfig:
        return cls(grace_s=options.drain_timeout_s)


async def drain(server: RunningServer, gate: DrainGate, link: IndexLink | None,
                busy: Callable[[], bool] = lambda: False,
                config: DrainConfig = DrainConfig()) -> bool:
    """Stop taking work and let what was taken finish (the module docstring's states), then
    stop the server. True if everything finished, False if the timeout cut something."""
    start = time.monotonic()
    end = start + config.grace_s
    log.info("draining: no new work; finishing %d call(s) in flight", gate.open)
    gate.advance(DrainState.NOTICE)
    await server.set_serving(False)
    if link is not None:
        await link.close()
        await asyncio.sleep(config.notice_s)
        end += config.notice_s
    gate.advance(DrainState.REFUSING)
    while (gate.open or busy()) and time.monotonic() < end:
        await asyncio.sleep(config.poll_s)
    left, finished = gate.open, not (gate.open or busy())
    gate.advance(DrainState.STOPPED)
    await server.stop(grace=LAST_CALLS_S if finished else 0)
    log.info("drained in %.1fs%s", time.monotonic() - start,
             "" if finished else f" (drain timeout: {left} call(s) and background work cut)")
    return finished
