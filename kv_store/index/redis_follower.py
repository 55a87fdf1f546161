"""Router side of the Redis index: tails the event stream and polls the lease registry.

Two background tasks feed one `IndexView`:

    follow:  bootstrap ──► XREAD BLOCK from cursor ──► decode ──► view.apply ──► (loop)
             bootstrap: first start → cursor = stream end, INCR resync (workers re-publish);
                        generation changed (Redis lost its data) → cursor = 0 (read it all);
                        otherwise (reconnect) → keep the cursor.
    poll:    every registry_poll_s: generation check, leases → view, expire lapsed workers,
             and a resync request if trimming removed entries this router never read.

While Redis is unreachable nothing expires: the router keeps routing on what it knows (a
hint; workers validate every hit). When it is back, every worker gets one lease period to
renew or re-register before it is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from redis import exceptions as rex

from kv_store.index.events import EventCodecError, decode_batch
from kv_store.index.redis_common import (
    Backoff,
    Keys,
    RedisIndexConfig,
    ensure_gen,
    raise_if_cancelling,
    read_leases,
)
from kv_store.index.view import IndexView

log = logging.getLogger(__name__)


class RedisFollower:
    """Keeps `view` in step with the Redis stream and registry."""

    def __init__(self, client: aioredis.Redis, keys: Keys, config: RedisIndexConfig) -> None:
        self._client, self._keys, self._config = client, keys, config
        self.view = IndexView()
        self._cursor = "0-0"
        self._gen: bytes | None = None
        self._bootstrap_due = True
        self._consumed = 0  # stream entries accounted for (read, or skipped at first start)
        self._outage = False  # an error happened since the last successful registry poll
        self._down_since: float | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.rejected_entries = 0
        """Stream entries skipped because they could not be decoded (foreign version...)."""
        self.resyncs_requested = 0

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._loop(self._follow_once, Backoff(
                self._config.retry_min_s, self._config.retry_max_s), 0.0), name="kv-follow"),
            asyncio.create_task(self._loop(self._poll_once, Backoff(
                self._config.retry_min_s, self._config.retry_max_s),
                self._config.registry_poll_s), name="kv-registry-poll"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    @property
    def connected(self) -> bool:
        return self._down_since is None

    async def _loop(self, step: Callable[[], Awaitable[None]], backoff: Backoff,
                    pause_s: float) -> None:
        while True:
            raise_if_cancelling()
            try:
                await step()
            except Exception as exc:  # the loop must outlive any failure
                raise_if_cancelling()
                self._on_failure(exc)
                await asyncio.sleep(backoff.next())
                continue
            backoff.reset()
            if pause_s:
                await asyncio.sleep(pause_s)

    # -- follow --------------------------------------------------------------------------
    async def _follow_once(self) -> None:
        if self._bootstrap_due:
            await self._bootstrap()
        reply = await self._client.xread({self._keys.stream: self._cursor},
                                         count=self._config.read_count,
                                         block=self._config.read_block_ms)
        self._on_success()
        for _stream, entries in reply or ():
            for entry_id, fields in entries:
                self._cursor = entry_id.decode()
                self._consumed += 1
                self._apply(fields.get(b"e"), time.monotonic())
                await asyncio.sleep(0)  # a snapshot burst must not stall the router's requests

    def _apply(self, data: bytes | None, now: float) -> None:
        try:
            events = decode_batch(data if data is not None else b"")
        except EventCodecError as exc:
            self.rejected_entries += 1
            if self.rejected_entries == 1 or self.rejected_entries % 1000 == 0:
                log.warning("KV index: skipped %d undecodable stream entries (last: %s)",
                            self.rejected_entries, exc)
            return
        self.view.apply(events, now)

    async def _bootstrap(self) -> None:
        gen = await ensure_gen(self._client, self._keys)
        if self._gen is None:
            # First start: what the stream holds may be trimmed, so ask for snapshots instead.
            added, _, last_id = await self._stream_counts()
            self._cursor, self._consumed = last_id, added
            await self._request_resync()
        elif gen != self._gen:
            log.warning("KV index: Redis lost its data; re-reading its event stream from the "
                        "start, keeping what is known until workers re-register")
            self._cursor, self._consumed = "0-0", 0
            self.view.extend_all(time.monotonic())
        self._gen = gen
        self._bootstrap_due = False

    # -- poll ----------------------------------------------------------------------------
    async def _poll_once(self) -> None:
        gen = await self._client.get(self._keys.gen)
        if gen != self._gen:
            self._bootstrap_due = True
        leases = await read_leases(self._client, self._keys, prune=True)
        now = time.monotonic()
        if self._outage:
            self.view.extend_all(now)
            self._outage = False
        for worker_id, (reg, remaining_s) in leases.items():
            self.view.observe_lease(worker_id, reg.info, reg.ttl_s, remaining_s, now)
        for worker_id in self.view.expire(now):
            log.info("KV index: lease of %s expired; dropped from the prefix index", worker_id)
        added, length, _ = await self._stream_counts()
        if not self._bootstrap_due and added - length > self._consumed:
            # Trimming removed entries this router never read: its view has holes.
            self._consumed = added - length
            await self._request_resync()
        self._on_success()

    async def _stream_counts(self) -> tuple[int, int, str]:
        """(entries ever added, entries kept, last id) of the stream; zeros if absent."""
        try:
            info = await self._client.xinfo_stream(self._keys.stream)
        except rex.ResponseError as exc:
            if "no such key" in str(exc):
                return 0, 0, "0-0"
            raise
        last = info.get("last-generated-id") or b"0-0"
        return int(info.get("entries-added", 0)), int(info["length"]), last.decode()

    async def _request_resync(self) -> None:
        await self._client.incr(self._keys.resync)
        self.resyncs_requested += 1

    # -- health --------------------------------------------------------------------------
    def _on_failure(self, exc: Exception) -> None:
        self._outage = True
        self._bootstrap_due = True
        if self._down_since is None:
            self._down_since = time.monotonic()
            log.warning("KV index: Redis unavailable (%s: %s); routing on what is known",
                        type(exc).__name__, exc)

    def _on_success(self) -> None:
        if self._down_since is not None:
            log.info("KV index: Redis reachable again after %.1fs",
                     time.monotonic() - self._down_since)
            self._down_since = None
