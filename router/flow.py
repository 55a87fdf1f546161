"""One request's journey through the cluster, as seen from the router.

One attempt (`_attempt`; its workers come from `router.placement`):

    pick D ─► Decode(D) ─► ready{cached_blocks, block_ids, endpoints, kv_lease_s, kv_ticket}
        ├─ short uncached prompt: D prefills itself (local_prefill), tokens follow
        ├─ another worker X holds a longer prefix and the rest is short: local_prefill with
        │  kv_source = X; D pulls the prefix from X (PushKV), then prefills the rest
        └─ else pick P ─► Prefill(P, target = D's blocks, lease, ticket) ─► first token
                          P streams KV to D; D decodes ─► tokens ... ─► finished

The request (`run`), with migration (`router.migration`):

    attempt 0 ──tokens──► client
       │ lost: D died / stopped answering / ended it; P lost before D had the KV
       ▼
    attempt n: another D, `generated_token_ids` = every token the client already has,
       local_prefill, kv_source = whoever holds the prompt's KV ──tokens after them──► client
       (at most `--migration-limit` moves; the old attempt's calls are cancelled first)

A worker that drains (`router.pool`) is given nothing new; one that refuses an attempt
because it drains (before anything ran there) is marked so, and the attempt is placed again
elsewhere (`drain_refusals`, within the same limit; not a migration). The streams it already
runs stay where they are and finish there.

Several choices of one prompt (`n` > 1) are one attempt: D forks them from the prompt's KV
(computed once, by P or by D) and every event carries its choice's `index`; such a request
moves to another worker only while nothing was streamed yet, and `stop_choice` ends one
choice (a stop string the router found) while the others go on.

While an attempt waits on D, D is watched (its heartbeats); until D's first event, so is P:
the moment either leaves its pool the attempt's calls are cancelled and it is lost. Every
exit path (finish, stop string, error, client cancel, deadline) cancels the calls still
open, which makes the workers abort the request and free its blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc

from pdserve.engine.finish import FinishReason
from pdserve.proto import pb, worker_pb
from pdserve.serving.convert import finish_from_pb, params_to_pb
from pdserve.serving.drain import is_draining_refusal
from router.migration import (
    LostCause,
    MigrationPolicy,
    cause_of_decode_error,
    prefill_lost,
)
from router.placement import NoWorker, Placement, PromptBlocks
from router.pool import WorkerHandle, WorkerPool
from router.validation import ValidRequest

log = logging.getLogger(__name__)


class FlowError(Exception):
    """Ends a request with a gRPC status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class AttemptLost(Exception):
    """A worker failed an attempt in a way another worker can make good."""

    def __init__(self, cause: LostCause, worker: WorkerHandle, detail: str) -> None:
        super().__init__(f"{worker.role} worker {worker.address}: {detail}")
        self.cause = cause
        self.worker = worker


@dataclass
class TokenEvent:
    token_ids: list[int]
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    """With sampling.prompt_logprobs: on the first event, from whichever worker prefilled."""
    index: int = 0
    """The choice (n > 1)."""


@dataclass
class FinishEvent:
    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    index: int = 0
    """The choice (n > 1); the request's stream ends after every choice's."""


@dataclass
class FlowTimings:
    """Router-side timestamps (perf_counter seconds) for the TTFT breakdown."""

    start: float = 0.0
    decode_ready: float = 0.0
    first_token: float = 0.0
    prefill_remote: bool = False
    prefill_compute_s: float = 0.0
    prefill_cached_tokens: int = 0


@dataclass(frozen=True)
class Attempt:
    """One try at a request: its id on the workers, and what the client already has."""

    rid: str
    generated: tuple[int, ...]
    seed: int
    deadline: float  # Unix seconds
    excluded: frozenset[str]  # workers that failed this request before

    def time_left(self) -> float:
        return max(self.deadline - time.time(), 0.001)


class Tripwire:
    """Cancels an attempt's calls the moment a worker it depends on leaves its pool, and
    remembers why; whoever awaited a cancelled call turns that into `AttemptLost`."""

    def __init__(self) -> None:
        self.tripped: tuple[LostCause, WorkerHandle] | None = None
        self._calls: list = []
        self._unwatch: list[Callable[[], None]] = []

    def guard(self, call) -> None:
        self._calls.append(call)
        if self.tripped is not None:
            call.cancel()

    def watch(self, w: WorkerHandle, cause: LostCause) -> Callable[[], None]:
        unwatch = w.watch(lambda: self._trip(cause, w))
        self._unwatch.append(unwatch)
        return unwatch

    def _trip(self, cause: LostCause, w: WorkerHandle) -> None:
        if self.tripped is None:
            self.tripped = (cause, w)
            for call in self._calls:
                call.cancel()

    def lost(self) -> AttemptLost | None:
        """The loss a cancelled call stands for; None if the task itself is cancelled."""
        task = asyncio.current_task()
        if self.tripped is None or (task is not None and task.cancelling()):
            return None
        cause, w = self.tripped
        return AttemptLost(cause, w, f"left its pool ({cause})")

    def close(self) -> None:
        for unwatch in self._unwatch:
            unwatch()


class Flow:
    def __init__(self, prefill: WorkerPool, decode: WorkerPool, local_prefill_tokens: int,
                 rng: random.Random, routing: str = "kv",
                 migration: MigrationPolicy | None = None) -> None:
        self.prefill = prefill
        self.decode = decode
        self.rng = rng
        self.migration = migration if migration is not None else MigrationPolicy()
        # Router-side counts: prefetch hints sent / failed, pulls routed, migrations (all,
        # and by cause as "migrations.<cause>"), attempts a draining worker refused.
        self.counters: dict[str, float] = {"prefetch_hints": 0, "prefetch_hint_failures": 0,
                                           "kv_pulls_routed": 0, "migrations": 0,
                                           "drain_refusals": 0}
        self.place = Placement(prefill, decode, local_prefill_tokens, routing, self.counters)
        self._live: dict[str, tuple[WorkerHandle, str]] = {}  # rid -> (D, attempt id) now

    @property
    def _background(self) -> set[asyncio.Task]:
        return self.place.background  # prefetch hints in flight

    def stop_choice(self, rid: str, index: int) -> None:
        """End choice `index` of request `rid` on its decode worker (fire-and-forget); its
        other choices go on. The flow still reads (and drops nothing of) the stream."""
        live = self._live.get(rid)
        if live is None or index < 0:
            return
        d, attempt = live
        target = attempt if index == 0 else f"{attempt}.c{index}"

        async def abort() -> None:
            with contextlib.suppress(grpc.aio.AioRpcError):  # it may have ended meanwhile
                await d.stub.Abort(worker_pb.AbortRequest(request_id=target), timeout=2.0)

        task = asyncio.create_task(abort())
        self._background.add(task)  # a reference, so the task is not collected mid-flight
        task.add_done_callback(self._background.discard)

    async def run(self, rid: str, req: ValidRequest, timeout_s: float,
                  timings: FlowTimings, n: int = 1, decode_allowed: frozenset[str] | None = None
                  ) -> AsyncIterator[TokenEvent | FinishEvent]:
        """`decode_allowed`: the decode workers admission control lets take the request's
        first attempt (None: any); a migration goes wherever placement finds room."""
        seed = req.params.seed if req.params.seed is not None else self.rng.getrandbits(63)
        deadline = time.time() + timeout_s
        timings.start = time.perf_counter()
        streamed: list[int] = []
        excluded: set[str] = set()
        moves = 0
        while True:
            a = Attempt(rid if moves == 0 else f"{rid}.m{moves}", tuple(streamed), seed,
                        deadline, frozenset(excluded))
            try:
                allowed = decode_allowed if moves == 0 else None
                async for ev in self._attempt(a, req, timings, n, rid, allowed):
                    if isinstance(ev, TokenEvent):
                        streamed.extend(ev.token_ids)
                    yield ev
                return
            except AttemptLost as lost:
                if n > 1 and streamed:  # each choice would need its own continuation
                    raise FlowError(grpc.StatusCode.UNAVAILABLE,
                                    f"{lost}; a request with n > 1 moves only before its "
                                    "first token") from None
                decision = self.migration.decide(lost.cause, moves, deadline - time.time())
                if not decision.migrate:
                    raise FlowError(decision.status, f"{lost}; {decision.reason}") from None
                moves += 1
                excluded.add(lost.worker.address)
                self._count_move(lost.cause)
                log.info("request %s moves on (%d/%d) after %d tokens: %s", rid, moves,
                         self.migration.limit, len(streamed), lost)

    def _count_move(self, cause: LostCause) -> None:
        if cause is LostCause.WORKER_DRAINING:
            self.counters["drain_refusals"] += 1
            return
        self.counters["migrations"] += 1
        key = f"migrations.{cause}"
        self.counters[key] = self.counters.get(key, 0) + 1

    # -- one attempt ---------------------------------------------------------------------
    async def _attempt(self, a: Attempt, req: ValidRequest, timings: FlowTimings, n: int = 1,
                       rid: str = "", allowed: frozenset[str] | None = None
                       ) -> AsyncIterator[TokenEvent | FinishEvent]:
        tokens = req.prompt_token_ids + list(a.generated)
        blocks = self.place.blocks(tokens)
        try:
            d = self.place.pick_decode(blocks.matches, set(a.excluded), allowed)
        except NoWorker as exc:
            raise FlowError(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
        self.place.hint(a.rid, d, blocks)
        self.place.expect_blocks(d, blocks.hashes)
        source = None if n > 1 else self.place.pull_source(  # forks: no pulls
            a.rid, d, blocks, len(tokens), continuation=bool(a.generated))
        remote = (source is None and not a.generated and self.place.prefill_remotely(
            len(tokens), d, blocks, set(a.excluded)))
        wire = Tripwire()
        call = d.stub.Decode(worker_pb.DecodeRequest(
            request_id=a.rid, prompt_token_ids=req.prompt_token_ids,
            sampling=params_to_pb(req.params), seed=a.seed, local_prefill=not remote,
            deadline_unix_s=a.deadline, kv_source=source, generated_token_ids=a.generated,
            n=n), timeout=a.time_left())
        wire.guard(call)
        wire.watch(d, LostCause.DECODE_UNRESPONSIVE)
        d.started()
        rid = rid or a.rid
        self._live[rid] = (d, a.rid)
        try:
            events = call.__aiter__()
            ready = await self._next(events, d, wire)
            timings.decode_ready = time.perf_counter()
            if ready is None or ready.WhichOneof("event") != "ready":
                raise FlowError(grpc.StatusCode.INTERNAL, "decode worker skipped the handshake")
            if remote:
                timings.prefill_remote = True
                first = await self._prefill(a, req, ready.ready, timings, blocks, wire)
                yield first
            async for ev in self._decode_events(events, d, wire, n):
                if remote and isinstance(ev, FinishEvent):
                    # The prompt was computed on P: what P reused is what was not recomputed
                    # (D's own hit only spared the transfer of those blocks).
                    ev.cached_tokens = timings.prefill_cached_tokens
                yield ev
        finally:
            self._live.pop(rid, None)
            d.ended()
            wire.close()
            call.cancel()  # no-op once finished; otherwise D aborts the request

    async def _prefill(self, a: Attempt, req: ValidRequest, ready: worker_pb.DecodeReady,
                       timings: FlowTimings, blocks: PromptBlocks, wire: Tripwire
                       ) -> TokenEvent:
        """Prefill on P into D's blocks. P stays watched until D's first event (its KV may
        never come if P goes), so the wire keeps that watch on when this returns."""
        try:
            p = self.place.pick_prefill(len(req.prompt_token_ids), blocks.matches,
                                        set(a.excluded))
        except NoWorker as exc:
            raise FlowError(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
        self.place.hint(a.rid, p, blocks)
        self.place.expect_blocks(p, blocks.hashes)
        lease_s = ready.kv_lease_s - (time.perf_counter() - timings.decode_ready)
        target = worker_pb.KVTarget(endpoints=ready.endpoints, block_ids=ready.block_ids,
                                    skip_blocks=ready.cached_blocks, lease_s=max(lease_s, 1e-3),
                                    kv_ticket=ready.kv_ticket)
        call = p.stub.Prefill(worker_pb.PrefillRequest(
            request_id=a.rid, prompt_token_ids=req.prompt_token_ids,
            sampling=params_to_pb(req.params), seed=a.seed, target=target,
            deadline_unix_s=a.deadline), timeout=a.time_left())
        wire.guard(call)
        wire.watch(p, LostCause.PREFILL_LOST)
        p.started()
        try:
            resp = await call
        except asyncio.CancelledError:
            lost = wire.lost()
            if lost is None:
                raise
            raise lost from None
        except grpc.aio.AioRpcError as exc:
            raise self._prefill_error(exc, p) from None
        finally:
            p.ended()
        timings.first_token = time.perf_counter()
        timings.prefill_compute_s = resp.compute_s
        timings.prefill_cached_tokens = resp.cached_tokens
        lps = [resp.logprob] if resp.HasField("logprob") else []
        return TokenEvent([resp.token_id], lps, list(resp.prompt_logprobs))

    async def _decode_events(self, events, d: WorkerHandle, wire: Tripwire, n: int = 1
                             ) -> AsyncIterator[TokenEvent | FinishEvent]:
        first = True
        running = set(range(n))
        while running:
            ev = await self._next(events, d, wire)
            if first:  # D has the KV: no prefill worker matters to this attempt any more
                first = False
                wire.close()
                wire.watch(d, LostCause.DECODE_UNRESPONSIVE)
            if ev is None:
                raise AttemptLost(LostCause.DECODE_ENDED, d, "its stream ended early")
            kind = ev.WhichOneof("event")
            if kind == "tokens":
                yield TokenEvent(list(ev.tokens.token_ids), list(ev.tokens.logprobs),
                                 list(ev.tokens.prompt_logprobs), ev.tokens.index)
            elif kind == "finished":
                f = ev.finished
                running.discard(f.index)
                yield FinishEvent(finish_from_pb(f.reason), f.prompt_tokens,
                                  f.completion_tokens, f.cached_tokens, f.index)

    async def _next(self, events, d: WorkerHandle, wire: Tripwire):
        try:
            return await events.__anext__()
        except StopAsyncIteration:
            return None
        except asyncio.CancelledError:
            lost = wire.lost()
            if lost is None:
                raise
            raise lost from None
        except grpc.aio.AioRpcError as exc:
            raise self._decode_error(exc, d) from None

    # -- errors --------------------------------------------------------------------------
    def _decode_error(self, exc: grpc.aio.AioRpcError, d: WorkerHandle) -> Exception:
        if is_draining_refusal(exc):  # alive, finishing its streams: just not this one
            self.decode.mark_draining(d)
            return AttemptLost(LostCause.WORKER_DRAINING, d, "it drains")
        code = exc.code()
        cause = cause_of_decode_error(code)
        if cause is LostCause.DECODE_LOST:
            self.decode.mark_failed(d)  # an unexpected worker fault: stop using it
        if cause is not None:
            return AttemptLost(cause, d, exc.details() or code.name)
        return FlowError(code, f"decode worker {d.address}: {exc.details()}")

    def _prefill_error(self, exc: grpc.aio.AioRpcError, p: WorkerHandle) -> Exception:
        if is_draining_refusal(exc):
            self.prefill.mark_draining(p)
            return AttemptLost(LostCause.WORKER_DRAINING, p, "it drains")
        code = exc.code()
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN):
            self.prefill.mark_failed(p)
        if prefill_lost(code):
            return AttemptLost(LostCause.PREFILL_LOST, p, exc.details() or code.name)
        return FlowError(code, f"prefill worker {p.address}: {exc.details()}")
