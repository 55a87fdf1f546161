"""Worker side of the Redis index: leases, heartbeats and event delivery, with recovery.

Callers only queue work (`publish`, `heartbeat`) and return; one background task talks to
Redis, so a slow or dead Redis never blocks or raises into a request path. Each registered
worker is in one of two states:

    ANNOUNCE ──SET lease, SADD id, XADD registration and snapshot (one MULTI)──► LIVE
       ▲                                                                  │
       └── lease key gone at heartbeat / generation token changed / ──────┘
           stream id went backwards / any error (Redis may have restarted) /
           a router asked for a resync / backlog overflow

Announcing replaces what routers know about the worker with its `snapshot()`, so block events
queued before it are dropped; events queued after it are delivered after it, in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from kv_store.index.base import SnapshotFn
from kv_store.index.events import (
    BlockRemoved,
    BlockStored,
    Event,
    WorkerGone,
    WorkerRegistered,
    encode_batch,
    pack_batches,
)
from kv_store.index.redis_common import (
    Backoff,
    Keys,
    RedisIndexConfig,
    ensure_gen,
    raise_if_cancelling,
    stream_id,
)

log = logging.getLogger(__name__)
_UNSET = object()


@dataclass
class _Registration:
    worker_id: str
    info: dict[str, Any]
    ttl_s: float
    snapshot: SnapshotFn | None
    announce: bool = True   # (re)announce due: lease + registration + snapshot
    beat: bool = False      # a heartbeat was asked for and not yet sent

    @property
    def event(self) -> WorkerRegistered:
        return WorkerRegistered(self.worker_id, self.info, self.ttl_s)


class RedisPublisher:
    """Delivers one process's worker registrations and block events to Redis."""

    def __init__(self, client: aioredis.Redis, keys: Keys, config: RedisIndexConfig) -> None:
        self._client, self._keys, self._config = client, keys, config
        self._regs: dict[str, _Registration] = {}
        self._queue: deque[tuple[int, Event]] = deque()  # (sequence number, event)
        self._queued_hashes = 0
        self._seq = 0
        self._gen: bytes | None = None
        self._resync: object = _UNSET
        self._last_id = (0, 0)
        self._checked = False  # generation verified since the last failure
        self._wake = asyncio.Event()
        self._progress = asyncio.Condition()
        self._backoff = Backoff(config.retry_min_s, config.retry_max_s)
        self._task: asyncio.Task[None] | None = None
        self.down_since: float | None = None
        self.announcements = 0
        """Registrations written (first ones and recoveries)."""

    # -- lifecycle -----------------------------------------------------------------------
    def start(self, gen: bytes | None, resync: object) -> None:
        """Start delivering; `gen`/`resync` as read at startup (None/_UNSET if unreachable)."""
        self._gen = gen
        self._resync = resync if gen is not None else _UNSET
        self._task = asyncio.create_task(self._run(), name="kv-index-publisher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    # -- caller side (never touches the network) -----------------------------------------
    async def register(self, worker_id: str, info: Mapping[str, Any], ttl_s: float,
                       snapshot: SnapshotFn | None) -> None:
        reg = _Registration(worker_id, dict(info), float(ttl_s), snapshot)
        encode_batch([reg.event])  # a non-serialisable info fails here, not in the loop
        self._drop_queued(worker_id)
        self._regs[worker_id] = reg
        self._wake.set()
        await self._wait(lambda: not reg.announce or self.down_since is not None,
                         self._config.register_wait_s)

    async def heartbeat(self, worker_id: str) -> None:
        self._registration(worker_id).beat = True
        self._wake.set()

    async def unregister(self, worker_id: str) -> None:
        if self._regs.pop(worker_id, None) is None:
            return
        self._drop_queued(worker_id)
        self._enqueue([WorkerGone(worker_id, "unregistered")])
        target = self._seq
        await self._wait(lambda: self._delivered(target) or self.down_since is not None,
                         self._config.register_wait_s)

    async def publish(self, events: Sequence[Event]) -> None:
        for e in events:
            if not isinstance(e, BlockStored | BlockRemoved):
                raise ValueError(f"publish takes block events only, got {type(e).__name__}")
            self._registration(e.worker_id)
        self._enqueue(events)
        if self._queued_hashes > self._config.max_pending_hashes:
            self._overflow()

    async def flush(self, timeout_s: float) -> bool:
        target = self._seq
        return await self._wait(
            lambda: self._delivered(target) and not any(
                r.announce or r.beat for r in self._regs.values()), timeout_s)

    def _registration(self, worker_id: str) -> _Registration:
        reg = self._regs.get(worker_id)
        if reg is None:
            raise ValueError(f"worker_id {worker_id!r} is not registered with this index")
        return reg

    def _enqueue(self, events: Sequence[Event]) -> None:
        for e in events:
            self._seq += 1
            self._queue.append((self._seq, e))
            self._queued_hashes += len(getattr(e, "hashes", ()))
        self._wake.set()

    def _delivered(self, seq: int) -> bool:
        return not self._queue or self._queue[0][0] > seq

    def _drop_queued(self, worker_id: str | None) -> None:
        """Forget queued block events of `worker_id` (of everybody when None)."""
        keep: deque[tuple[int, Event]] = deque()
        for item in self._queue:
            e = item[1]
            if isinstance(e, BlockStored | BlockRemoved) and worker_id in (None, e.worker_id):
                self._queued_hashes -= len(e.hashes)
            else:
                keep.append(item)
        self._queue = keep

    def _overflow(self) -> None:
        log.warning("KV index: %d hashes queued for Redis; dropping them, workers will "
                    "re-publish their snapshot", self._queued_hashes)
        self._drop_queued(None)
        for reg in self._regs.values():
            reg.announce = True

    async def _wait(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        async with self._progress:
            try:
                await asyncio.wait_for(self._progress.wait_for(predicate), timeout_s)
            except TimeoutError:
                return False
        return True

    # -- the delivery loop ---------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            raise_if_cancelling()
            self._wake.clear()
            try:
                await self._cycle()
            except Exception as exc:  # the loop must outlive any failure
                raise_if_cancelling()
                self._on_failure(exc)
                await self._notify()
                await asyncio.sleep(self._backoff.next())
                continue
            self._on_success()
            await self._notify()
            await self._wake.wait()

    async def _cycle(self) -> None:
        if not self._checked or any(r.beat for r in self._regs.values()):
            await self._check()
        for reg in list(self._regs.values()):
            if reg.announce and self._regs.get(reg.worker_id) is reg:
                await self._announce(reg)
        while self._queue:
            await self._send_some()

    async def _check(self) -> None:
        """Heartbeats, plus the generation and resync checks that ride along with them."""
        beats = [r for r in self._regs.values() if r.beat]
        async with self._client.pipeline(transaction=False) as pipe:
            pipe.get(self._keys.gen)
            pipe.get(self._keys.resync)
            for reg in beats:
                pipe.pexpire(self._keys.lease(reg.worker_id), _ms(reg.ttl_s))
            if beats:
                pipe.sadd(self._keys.workers, *(r.worker_id for r in beats))
            gen, resync, *renewed = await pipe.execute()
        renewed = renewed[:len(beats)]
        for reg, ok in zip(beats, renewed, strict=True):
            reg.beat = False
            if not ok:
                log.info("KV index: lease of %s was gone; re-registering", reg.worker_id)
                reg.announce = True
        if gen is None or gen != self._gen:
            if self._gen is not None:
                log.warning("KV index: Redis lost its data; re-registering all workers")
            self._gen = await ensure_gen(self._client, self._keys)
            self._reannounce_all()
        elif self._resync is not _UNSET and resync != self._resync:
            log.info("KV index: a router asked for a resync; re-publishing block sets")
            self._reannounce_all()
        self._resync = resync
        self._checked = True

    async def _announce(self, reg: _Registration) -> None:
        snapshot = _take_snapshot(reg)
        if snapshot is not None:
            self._drop_queued(reg.worker_id)  # the snapshot supersedes them
        events: list[Event] = [reg.event]
        events += [BlockStored(reg.worker_id, hs, tier) for tier, hs in (snapshot or {}).items()
                   if hs]
        entries = pack_batches(events, self._config.max_hashes_per_entry)
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.set(self._keys.lease(reg.worker_id), encode_batch([reg.event]),
                     px=_ms(reg.ttl_s))
            pipe.sadd(self._keys.workers, reg.worker_id)
            for entry in entries:
                self._xadd(pipe, entry)
            pipe.get(self._keys.resync)
            replies = await pipe.execute()
        self._note_ids(replies[2:-1])
        self._resync = replies[-1]
        reg.announce = False
        self.announcements += 1

    async def _send_some(self) -> None:
        """Deliver a bounded prefix of the queue in one round trip; pop it only on success."""
        budget = self._config.max_hashes_per_entry * 16
        items: list[tuple[int, Event]] = []
        for item in self._queue:
            items.append(item)
            budget -= max(1, len(getattr(item[1], "hashes", ())))
            if budget <= 0:
                break
        events = [e for _, e in items]
        gone = [e.worker_id for e in events if isinstance(e, WorkerGone)]
        async with self._client.pipeline(transaction=False) as pipe:
            for worker_id in gone:
                pipe.delete(self._keys.lease(worker_id))
                pipe.srem(self._keys.workers, worker_id)
            for entry in pack_batches(events, self._config.max_hashes_per_entry):
                self._xadd(pipe, entry)
            replies = await pipe.execute()
        self._note_ids(replies[2 * len(gone):])
        # Callers may have filtered the queue meanwhile: pop by sequence number, not count.
        last = items[-1][0]
        while self._queue and self._queue[0][0] <= last:
            _, e = self._queue.popleft()
            self._queued_hashes -= len(getattr(e, "hashes", ()))

    def _xadd(self, pipe: Any, entry: bytes) -> None:
        pipe.xadd(self._keys.stream, {"e": entry}, maxlen=self._config.stream_maxlen,
                  approximate=True)

    def _note_ids(self, ids: Sequence[bytes]) -> None:
        for raw in ids:
            sid = stream_id(raw)
            if sid < self._last_id:
                log.warning("KV index: event stream id went backwards; re-registering")
                self._reannounce_all()
            self._last_id = sid

    def _reannounce_all(self) -> None:
        for reg in self._regs.values():
            reg.announce = True

    def _on_failure(self, exc: Exception) -> None:
        if self.down_since is None:
            self.down_since = time.monotonic()
            log.warning("KV index: Redis unavailable (%s: %s); worker updates are queued and "
                        "retried", type(exc).__name__, exc)
        self._checked = False
        self._reannounce_all()  # Redis may come back empty: re-register once it is back

    def _on_success(self) -> None:
        if self.down_since is not None:
            log.info("KV index: Redis reachable again after %.1fs",
                     time.monotonic() - self.down_since)
            self.down_since = None
        self._backoff.reset()

    async def _notify(self) -> None:
        async with self._progress:
            self._progress.notify_all()


def _take_snapshot(reg: _Registration) -> dict | None:
    if reg.snapshot is None:
        return None
    try:
        return {tier: list(hs) for tier, hs in reg.snapshot().items()}
    except Exception:  # a worker bug must not stop the index loop
        log.exception("KV index: snapshot() of %s failed; registering without blocks",
                      reg.worker_id)
        return None


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))
