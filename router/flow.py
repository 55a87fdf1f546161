"""One request's journey through the cluster, as seen from the router.

    pick D ─► Decode(D) ─► ready{cached_blocks, block_ids, endpoints}
        ├─ short uncached prompt: D prefills itself (local_prefill), tokens follow
        ├─ another worker X holds a longer prefix and the rest is short: local_prefill with
        │  kv_source = X; D pulls the prefix from X (PushKV), then prefills the rest
        └─ else pick P ─► Prefill(P, target = D's blocks) ─► first token (streamed at once)
                          P streams KV to D; D decodes ─► tokens ... ─► finished

Each worker chosen (D, X, P) whose prefix match runs into its host/SSD tiers first gets a
fire-and-forget `Prefetch` of those blocks, so they climb while the request is queued.

Every exit path (finish, stop string, error, client cancel, deadline) cancels the calls still
open, which makes the workers abort the request and free its blocks.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from kv_store.index.events import Tier
from kv_store.index.prefix import PrefixMatch
from pdserve.block_hash import chain_hashes
from pdserve.proto import pb, worker_pb
from pdserve.serving.convert import FINISH_FROM_PB, params_to_pb
from router import policy
from router.pool import WorkerHandle, WorkerPool
from router.validation import ValidRequest

PREFETCH_TIMEOUT_S = 2.0  # a prefetch hint not taken by then is moot; never waited for


class FlowError(Exception):
    """Ends a request with a gRPC status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class TokenEvent:
    token_ids: list[int]
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)


@dataclass
class FinishEvent:
    reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class PromptBlocks:
    """The prompt's block hashes and what each worker holds of them (KV index: a hint)."""

    hashes: list[bytes]
    matches: dict[str, PrefixMatch]

    def held_by(self, w: WorkerHandle) -> int:
        m = self.matches.get(w.address)
        return m.blocks if m is not None else 0


@dataclass
class FlowTimings:
    """Router-side timestamps (perf_counter seconds) for the TTFT breakdown."""

    start: float = 0.0
    decode_ready: float = 0.0
    first_token: float = 0.0
    prefill_remote: bool = False
    prefill_compute_s: float = 0.0
    prefill_cached_tokens: int = 0


class Flow:
    def __init__(self, prefill: WorkerPool, decode: WorkerPool, local_prefill_tokens: int,
                 rng: random.Random, routing: str = "kv") -> None:
        if routing not in ("kv", "round-robin"):
            raise ValueError(f"routing must be 'kv' or 'round-robin', got {routing!r}")
        self.prefill = prefill
        self.decode = decode
        self.local_prefill_tokens = local_prefill_tokens
        self.rng = rng
        self.routing = routing
        self._turn = {"prefill": 0, "decode": 0}  # round-robin cursors
        # Router-side counts: prefetch hints sent / failed, pulls routed.
        self.counters = {"prefetch_hints": 0, "prefetch_hint_failures": 0, "kv_pulls_routed": 0}
        self._background: set[asyncio.Task] = set()  # prefetch hints in flight

    async def run(self, rid: str, req: ValidRequest, timeout_s: float,
                  timings: FlowTimings, decode_allowed: frozenset[str] | None = None
                  ) -> AsyncIterator[TokenEvent | FinishEvent]:
        """`decode_allowed`: addresses admission control lets take it (None: any)."""
        seed = req.params.seed if req.params.seed is not None else self.rng.getrandbits(63)
        deadline = time.time() + timeout_s
        timings.start = time.perf_counter()
        blocks = self._prompt_blocks(req.prompt_token_ids)
        d = self._pick_decode(blocks.matches, decode_allowed)
        self._hint(rid, d, blocks)
        self._expect_blocks(d, blocks.hashes)
        source = self._pull_source(rid, d, blocks, len(req.prompt_token_ids))
        remote = source is None and policy.prefill_remotely(
            len(req.prompt_token_ids), blocks.held_by(d) * self._block_size(),
            self.local_prefill_tokens, bool(self.prefill.healthy()))
        call = d.stub.Decode(worker_pb.DecodeRequest(
            request_id=rid, prompt_token_ids=req.prompt_token_ids,
            sampling=params_to_pb(req.params), seed=seed, local_prefill=not remote,
            deadline_unix_s=deadline, kv_source=source), timeout=timeout_s)
        d.inflight += 1
        try:
            events = call.__aiter__()
            ready = await self._next(events, d, self.decode)
            timings.decode_ready = time.perf_counter()
            if ready is None or ready.WhichOneof("event") != "ready":
                raise FlowError(grpc.StatusCode.INTERNAL, "decode worker skipped the handshake")
            watch = None
            if remote:
                timings.prefill_remote = True
                first, watch = await self._prefill(rid, req, seed, ready.ready, deadline,
                                                   timings, blocks)
                yield first
            async for ev in self._decode_events(events, d, watch):
                if remote and isinstance(ev, FinishEvent):
                    # The prompt was computed on P: what P reused is what was not recomputed
                    # (D's own hit only spared the transfer of those blocks).
                    ev.cached_tokens = timings.prefill_cached_tokens
                yield ev
        finally:
            d.inflight -= 1
            call.cancel()  # no-op once finished; otherwise D aborts the request

    async def _prefill(self, rid: str, req: ValidRequest, seed: int,
                       ready: worker_pb.DecodeReady, deadline: float,
                       timings: FlowTimings, blocks: PromptBlocks
                       ) -> tuple[TokenEvent, WorkerHandle]:
        p = self._pick_prefill(len(req.prompt_token_ids), blocks.matches)
        self._hint(rid, p, blocks)
        self._expect_blocks(p, blocks.hashes)
        target = worker_pb.KVTarget(endpoints=ready.endpoints, block_ids=ready.block_ids,
                                    skip_blocks=ready.cached_blocks)
        p.inflight += 1
        try:
            resp = await p.stub.Prefill(worker_pb.PrefillRequest(
                request_id=rid, prompt_token_ids=req.prompt_token_ids,
                sampling=params_to_pb(req.params), seed=seed, target=target,
                deadline_unix_s=deadline), timeout=max(deadline - time.time(), 0.001))
        except grpc.aio.AioRpcError as exc:
            raise _flow_error(exc, p, self.prefill) from None
        finally:
            p.inflight -= 1
        timings.first_token = time.perf_counter()
        timings.prefill_compute_s = resp.compute_s
        timings.prefill_cached_tokens = resp.cached_tokens
        lps = [resp.logprob] if resp.HasField("logprob") else []
        return TokenEvent([resp.token_id], lps), p

    async def _decode_events(self, events, d: WorkerHandle, watch: WorkerHandle | None
                             ) -> AsyncIterator[TokenEvent | FinishEvent]:
        """D's events. Until the first one, also watch the prefill worker that is streaming
        the KV: if it leaves its pool, the KV may never come, so fail now, not at a timeout."""
        first = True
        while True:
            if first and watch is not None:
                ev = await self._next_or_down(events, d, watch)
                first = False
            else:
                ev = await self._next(events, d, self.decode)
            if ev is None:
                raise FlowError(grpc.StatusCode.UNAVAILABLE, "decode stream ended early")
            kind = ev.WhichOneof("event")
            if kind == "tokens":
                yield TokenEvent(list(ev.tokens.token_ids), list(ev.tokens.logprobs))
            elif kind == "finished":
                f = ev.finished
                yield FinishEvent(FINISH_FROM_PB.get(f.reason, "abort"), f.prompt_tokens,
                                  f.completion_tokens, f.cached_tokens)
                return

    async def _next_or_down(self, events, d: WorkerHandle, p: WorkerHandle):
        nxt = asyncio.ensure_future(self._next(events, d, self.decode))
        down = asyncio.ensure_future(p.down.wait())
        try:
            await asyncio.wait({nxt, down}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            down.cancel()
        if nxt.done():
            return nxt.result()
        nxt.cancel()
        raise FlowError(grpc.StatusCode.UNAVAILABLE,
                        f"prefill worker {p.address} went down before its KV arrived")

    async def _next(self, events, worker: WorkerHandle, pool: WorkerPool):
        try:
            return await events.__anext__()
        except StopAsyncIteration:
            return None
        except grpc.aio.AioRpcError as exc:
            raise _flow_error(exc, worker, pool) from None

    def _block_size(self) -> int:
        info = next((w.info for w in self.decode.workers if w.info is not None), None)
        return info.block_size if info is not None and info.block_size else 16

    def _prompt_blocks(self, prompt: list[int]) -> PromptBlocks:
        """The prompt's hashes and the leading blocks each worker holds (KV index, a hint)."""
        hashes = self._hashes(prompt)
        return PromptBlocks(hashes, self.decode.prefix.match(hashes) if hashes else {})

    def _hashes(self, prompt: list[int]) -> list[bytes]:
        info = next((w.info for w in self.decode.workers if w.info is not None), None)
        if info is None or not info.hash_extra:
            return []
        return chain_hashes(prompt, info.block_size, info.hash_extra)

    def _expect_blocks(self, worker: WorkerHandle, hashes: list[bytes]) -> None:
        """Record at once that `worker` is about to hold this prompt's blocks. The worker's
        own events confirm (or a snapshot corrects) this a poll later; without it, a burst of
        requests for a new prefix would be spread before the index learns where it went."""
        if self.routing == "kv" and hashes:
            self.decode.prefix.store(worker.address, hashes, Tier.DEVICE)

    def _pull_source(self, rid: str, d: WorkerHandle, blocks: PromptBlocks, prompt_tokens: int
                     ) -> worker_pb.KVSource | None:
        """Where D should pull the prompt's prefix from (policy.pick_pull_source), if any."""
        others = [w for w in (*self.decode.healthy(), *self.prefill.healthy())
                  if w.address != d.address and w.address in blocks.matches]
        holders = [policy.Holder(i, blocks.matches[w.address].blocks,
                                 blocks.matches[w.address].leading[0],
                                 w.info.tp_size if w.info is not None else 0)
                   for i, w in enumerate(others)]
        h = policy.pick_pull_source(holders, blocks.held_by(d), prompt_tokens,
                                    self._block_size(), self.local_prefill_tokens,
                                    bool(self.prefill.healthy()))
        if h is None:
            return None
        self.counters["kv_pulls_routed"] += 1
        self._hint(rid, others[h.index], blocks)
        return worker_pb.KVSource(address=others[h.index].address, blocks=h.blocks)

    def _hint(self, rid: str, w: WorkerHandle, blocks: PromptBlocks) -> None:
        """Fire-and-forget Prefetch of `w`'s matched blocks that sit in its host/SSD tiers."""
        m = blocks.matches.get(w.address)
        hashes = policy.prefetch_hashes(m.leading, blocks.hashes) if m is not None else []
        if not hashes:
            return
        self.counters["prefetch_hints"] += 1
        task = asyncio.create_task(self._prefetch(rid, w, hashes))
        self._background.add(task)  # a reference, so the task is not collected mid-flight
        task.add_done_callback(self._background.discard)

    async def _prefetch(self, rid: str, w: WorkerHandle, hashes: list[bytes]) -> None:
        try:
            await w.stub.Prefetch(worker_pb.PrefetchRequest(request_id=rid, block_hashes=hashes),
                                  timeout=PREFETCH_TIMEOUT_S)
        except grpc.aio.AioRpcError:  # only a hint: the request goes on without it
            self.counters["prefetch_hint_failures"] += 1

    def _round_robin(self, role: str, healthy: list[WorkerHandle]) -> int | None:
        if not healthy:
            return None
        self._turn[role] += 1
        return self._turn[role] % len(healthy)

    def _pick_decode(self, matches: dict[str, PrefixMatch],
                     allowed: frozenset[str] | None = None) -> WorkerHandle:
        healthy = [w for w in self.decode.healthy() if allowed is None or w.address in allowed]
        if self.routing == "round-robin":
            i = self._round_robin("decode", healthy)
        else:
            i = policy.pick_decode([_load(i, w, matches) for i, w in enumerate(healthy)])
        if i is None:
            raise FlowError(grpc.StatusCode.UNAVAILABLE, "no healthy decode worker")
        return healthy[i]

    def _pick_prefill(self, prompt_tokens: int, matches: dict[str, PrefixMatch]
                      ) -> WorkerHandle:
        healthy = self.prefill.healthy()
        if self.routing == "round-robin":
            i = self._round_robin("prefill", healthy)
        else:
            i = policy.pick_prefill([_load(i, w, matches) for i, w in enumerate(healthy)],
                                    prompt_tokens, self._block_size())
        if i is None:
            raise FlowError(grpc.StatusCode.UNAVAILABLE, "no healthy prefill worker")
        return healthy[i]


def _load(i: int, w: WorkerHandle, matches: dict[str, PrefixMatch]) -> policy.Load:
    s = w.stats
    m = matches.get(w.address)
    cached = policy.weighted_blocks(m.leading) if m is not None else 0.0
    return policy.Load(i, int(s.queued_prefill_tokens), int(s.kv_blocks_used),
                       int(s.kv_blocks_total), w.inflight, cached)


def _flow_error(exc: grpc.aio.AioRpcError, worker: WorkerHandle, pool: WorkerPool) -> FlowError:
    code = exc.code()
    if code == grpc.StatusCode.UNKNOWN:
        code = grpc.StatusCode.UNAVAILABLE  # an unexpected worker fault: stop using it
    if code == grpc.StatusCode.UNAVAILABLE:
        pool.mark_failed(worker)
    if code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED):
        # The worker went away mid-call, or lost this request's KV: retryable by the client.
        code = grpc.StatusCode.UNAVAILABLE
    return FlowError(code, f"{worker.role} worker {worker.address}: {exc.details()}")
