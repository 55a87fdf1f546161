"""In-process KV index: the embedded default, no external service.

Registration, events and the router's view live in one `IndexView` in this process. A
background task expires lapsed leases, so a worker that stops heartbeating disappears from
`match` like it does with Redis. Silence counts only while this process runs: the heartbeats
come through this event loop too, so after a stall of the loop (CPU starvation, a pause)
every lease gets a full ttl again before anything is judged, as the router's pools do. In a
multi-process deployment without Redis, the router owns the `LocalKVIndex` and calls
`register`/`publish` on behalf of workers whose events reach it another way (they are plain
msgpack bytes, see `events.encode_batch`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kv_store.index.base import KVIndex, SnapshotFn, check_registration
from kv_store.index.events import (
    BlockRemoved,
    BlockStored,
    Event,
    WorkerGone,
    WorkerRegistered,
    check_worker_id,
    encode_batch,
)
from kv_store.index.prefix import PrefixIndex
from kv_store.index.view import IndexView


@dataclass
class _Registration:
    info: dict[str, Any]
    ttl_s: float
    snapshot: SnapshotFn | None


class LocalKVIndex(KVIndex):
    """The whole index in this process's memory."""

    def __init__(self, reap_interval_s: float = 0.25) -> None:
        if not reap_interval_s > 0:
            raise ValueError(f"reap_interval_s must be positive, got {reap_interval_s!r}")
        self._reap_interval_s = reap_interval_s
        self._view = IndexView()
        self._regs: dict[str, _Registration] = {}
        self._reaper: asyncio.Task[None] | None = None
        self._last_look = time.monotonic()
        # A gap this long between looks means the loop did not run: nobody could renew.
        self._stall_s = max(4 * reap_interval_s, 1.0)

    async def start(self) -> None:
        if self._reaper is None:
            self._reaper = asyncio.create_task(self._reap(), name="kv-index-reaper")

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
            self._reaper = None

    async def register(self, worker_id: str, info: Mapping[str, Any], ttl_s: float,
                       snapshot: SnapshotFn | None = None) -> None:
        check_worker_id(worker_id)
        check_registration(info, ttl_s)
        reg = _Registration(dict(info), float(ttl_s), snapshot)
        encode_batch([WorkerRegistered(worker_id, reg.info, reg.ttl_s)])  # same checks as Redis
        self._regs[worker_id] = reg
        self._announce(worker_id, reg)

    async def heartbeat(self, worker_id: str) -> None:
        reg = self._registration(worker_id)
        if not self._view.renew(worker_id, time.monotonic()):
            self._announce(worker_id, reg)  # lease lapsed: start over with a snapshot

    async def unregister(self, worker_id: str) -> None:
        if self._regs.pop(worker_id, None) is not None:
            self._view.apply([WorkerGone(worker_id, "unregistered")], time.monotonic())

    async def publish(self, events: Sequence[Event]) -> None:
        for e in events:
            if not isinstance(e, BlockStored | BlockRemoved):
                raise ValueError(f"publish takes block events only, got {type(e).__name__}")
            self._registration(e.worker_id)
        self._view.apply(events, time.monotonic())

    async def flush(self, timeout_s: float = 5.0) -> bool:
        return True

    async def workers(self) -> dict[str, dict[str, Any]]:
        self._expire(time.monotonic())
        return self._view.workers()

    @property
    def prefix(self) -> PrefixIndex:
        return self._view.prefix

    def _registration(self, worker_id: str) -> _Registration:
        reg = self._regs.get(worker_id)
        if reg is None:
            raise ValueError(f"worker_id {worker_id!r} is not registered with this index")
        return reg

    def _announce(self, worker_id: str, reg: _Registration) -> None:
        events: list[Event] = [WorkerRegistered(worker_id, reg.info, reg.ttl_s)]
        if reg.snapshot is not None:
            events += [BlockStored(worker_id, hs, tier) for tier, hs in reg.snapshot().items()]
        self._view.apply(events, time.monotonic())

    def _expire(self, now: float) -> None:
        if now - self._last_look > self._stall_s:
            self._view.extend_all(now)
        self._last_look = now
        self._view.expire(now)

    async def _reap(self) -> None:
        self._last_look = time.monotonic()
        while True:
            await asyncio.sleep(self._reap_interval_s)
            self._expire(time.monotonic())
