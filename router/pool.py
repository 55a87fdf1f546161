"""Worker pools: channels, load figures and health, refreshed by polling `GetStats`.

Heartbeats: each worker is polled every `period_s` on its own (a worker that hangs never
delays the others' polls). A worker whose last answer is older than `heartbeat_timeout_s`
(it stopped answering: dead, stopped, cut off), or that fails a call with UNAVAILABLE, leaves
its pool until it answers again; requests only ever go to healthy workers that do not drain.
Detection takes at most `heartbeat_timeout_s` plus one tick (`period_s / 2`). Flows that
depend on a worker `watch` it and are told the moment it leaves (the router then migrates
their requests).

    poll ok ──► last_ok = now, healthy      now - last_ok > heartbeat_timeout_s ──► down

Silence is counted only while the router watches: after a tick far later than due (the
router's own process did not run, so answers sat unread in its sockets) the clock of every
worker restarts from then, and everyone is polled at once.

A worker that drains (it got SIGTERM: `pdserve.serving.drain`) says so in its stats and keeps
answering its polls: it stays healthy (nobody watching it is told it left, so the streams on
it finish there) but is not *routable*: no new request, pull or migration goes to it. A call
it refused because it drains marks it so at once, before the next poll.

    healthy, routable ──stats.draining / a `pdserve-draining` refusal──► healthy, draining
                                            ──it exits: polls fail──► down (as above)

Membership can change at run time (`add` / `remove`, driven by `router.membership` in
discovery mode, or by an operator):

    add(addr) ──► member ──poll ok──► healthy (routable)
                    │ ▲
           remove() │ │ add() again (same handle, same channel)
                    ▼ │
                 retiring ──inflight 0, linger_s passed──► channel closed, forgotten

A retiring worker gets no new requests, but the flows that hold its `WorkerHandle` finish on
its open channel; it is still polled (health only), so a crash still sets its `down` event.

The pools also keep the shared `PrefixIndex` (which prompt blocks each worker holds) up to date
from the KV events in the workers' stats, unless another source owns it (`events_from_stats`
False: the Redis KV index, fed by the workers themselves; its leases retire dead workers).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from kv_store.index.events import BlockRemoved, BlockStored, EventCodecError, decode_batch
from kv_store.index.prefix import PrefixIndex
from pdserve.proto import worker_pb, worker_pb_grpc
from pdserve.serving.grpc_server import MAX_MESSAGE_BYTES
from pdserve.serving.security import ClientSecurity

log = logging.getLogger(__name__)

_CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]


@dataclass(frozen=True)
class PoolTotals:
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_cache_queries: float
    prefix_cache_hits: float
    preemptions: float
    block_size: int


@dataclass
class WorkerHandle:
    address: str
    role: str
    channel: grpc.aio.Channel
    stub: worker_pb_grpc.WorkerStub
    healthy: bool = False
    last_ok: float = field(default_factory=time.monotonic)  # of the last answered poll
    inflight: int = 0  # requests this router has sent and not yet seen finish
    ended_since_poll: int = 0  # requests of this router that ended since `stats` was taken
    stats: worker_pb.WorkerStats = field(default_factory=worker_pb.WorkerStats)
    info: worker_pb.WorkerInfo | None = None
    # Set when the worker leaves its pool. Replaced when the worker comes back.
    down: asyncio.Event = field(default_factory=asyncio.Event)
    needs_snapshot: bool = True  # resync its KV index entries on the next poll
    refuses_credentials: bool = False  # its last poll got UNAUTHENTICATED (logged once)
    draining: bool = False  # it said so (stats) or refused a call for it; polls clear it
    polls: int = 0  # answered stats polls (their KV events applied): exported, tests wait on it
    _watchers: set[Callable[[], None]] = field(default_factory=set, repr=False)

    def started(self) -> None:
        """A request of this router is on the worker now."""
        self.inflight += 1

    def ended(self) -> None:
        self.inflight -= 1
        self.ended_since_poll += 1

    def take_stats(self, stats: worker_pb.WorkerStats, ended_before: int) -> None:
        """Fresh stats from a call sent when `ended_since_poll` was `ended_before`: what
        ended meanwhile may or may not be in them, and stays counted (a request judged
        gone too early costs a little queueing; one judged still there refuses a request)."""
        self.stats = stats
        self.ended_since_poll = max(self.ended_since_poll - ended_before, 0)

    def occupancy(self) -> int:
        """Requests it holds, as best known: its last stats less this router's requests that
        ended since (the stats lag up to a poll period: a client sending one request after
        another would otherwise find the last one still there), and never fewer than this
        router has on it now. Other routers' requests are known from the stats only."""
        polled = int(self.stats.num_running + self.stats.num_waiting)
        return max(polled - self.ended_since_poll, self.inflight)

    def set_healthy(self, healthy: bool) -> None:
        if healthy and not self.healthy:
            self.down = asyncio.Event()
        elif not healthy and self.healthy:
            self.down.set()
            self.needs_snapshot = True
            watchers, self._watchers = self._watchers, set()
            for fn in watchers:
                fn()
        self.healthy = healthy

    @property
    def routable(self) -> bool:
        """Whether new work may go to it: healthy and not draining."""
        return self.healthy and not self.draining

    def watch(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Call `fn()` once, as soon as this worker leaves its pool (at once if it is out
        already); returns the function that stops watching."""
        if not self.healthy:
            fn()
            return lambda: None
        self._watchers.add(fn)
        return lambda: self._watchers.discard(fn)


class WorkerPool:
    def __init__(self, role: str, addresses: tuple[str, ...], period_s: float,
                 heartbeat_timeout_s: float, prefix: PrefixIndex | None = None,
                 events_from_stats: bool = True, linger_s: float | None = None,
                 security: ClientSecurity | None = None) -> None:
        self.role = role
        self.security = security or ClientSecurity()  # TLS and cluster secret to workers
        self.workers: list[WorkerHandle] = []  # members; only their healthy ones are routable
        self.period_s = period_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        # A removed worker's channel stays open at least this long once idle: fire-and-forget
        # calls (prefetch hints) do not count in `inflight`.
        self.linger_s = 2 * period_s if linger_s is None else linger_s
        # Which prompt blocks each worker holds, fed by the events in its stats (a hint:
        # workers check every hit themselves). Shared by the router's pools.
        self.prefix = prefix if prefix is not None else PrefixIndex()
        # False: `prefix` belongs to another feed; ask for no events and never edit it.
        self.events_from_stats = events_from_stats
        self._retiring: dict[str, tuple[WorkerHandle, float]] = {}  # address → (handle, since)
        self._wake = asyncio.Event()  # a member joined: poll now, not a period later
        self._task: asyncio.Task | None = None
        self._polls: dict[str, tuple[asyncio.Task, float]] = {}  # address → (poll, started)
        self._watching_since = 0.0  # when the poll loop last resumed after a stall
        for address in addresses:
            self.add(address)

    def healthy(self) -> list[WorkerHandle]:
        """Members that answer their polls (draining ones included: they finish their work)."""
        return [w for w in self.workers if w.healthy]

    def routable(self) -> list[WorkerHandle]:
        """Members new work may go to: healthy and not draining."""
        return [w for w in self.workers if w.routable]

    def totals(self) -> PoolTotals:
        """KV blocks and cache counters summed over the healthy members' last stats."""
        live = self.healthy()
        counter = lambda name: sum(w.stats.counters.get(name, 0.0) for w in live)  # noqa: E731
        sizes = [w.info.block_size for w in live if w.info is not None and w.info.block_size]
        return PoolTotals(sum(w.stats.kv_blocks_used for w in live),
                          sum(w.stats.kv_blocks_total for w in live),
                          counter("prefix_cache_queries"), counter("prefix_cache_hits"),
                          counter("num_preemptions"), sizes[0] if sizes else 0)

    async def refresh_stats(self, timeout_s: float = 1.0) -> None:
        """Fresh load figures of the healthy members now (a metrics scrape), without taking
        their KV events or judging their health: the poll loop owns both."""
        async def one(w: WorkerHandle) -> None:
            with contextlib.suppress(grpc.aio.AioRpcError):
                ended = w.ended_since_poll
                w.take_stats(await w.stub.GetStats(worker_pb.StatsRequest(), timeout=timeout_s),
                             ended)

        await asyncio.gather(*(one(w) for w in self.healthy()))

    def add(self, address: str) -> WorkerHandle:
        """Make `address` a member (idempotent). A retiring worker gets its handle back; a new
        one is routable once a poll finds it healthy (the poller is woken at once)."""
        for w in self.workers:
            if w.address == address:
                return w
        retired = self._retiring.pop(address, None)
        if retired is not None:
            w = retired[0]
        else:
            channel = self.security.aio_channel(address, _CHANNEL_OPTIONS)
            w = WorkerHandle(address, self.role, channel, worker_pb_grpc.WorkerStub(channel))
        self.workers.append(w)
        self._wake.set()
        return w

    def remove(self, address: str) -> bool:
        """Stop routing to `address` (idempotent; False if it was not a member). Flows already
        using it finish: its channel closes once `inflight` is 0 (see the module docstring)."""
        w = next((x for x in self.workers if x.address == address), None)
        if w is None:
            return False
        self.workers = [x for x in self.workers if x is not w]
        self._forget_blocks(w)
        w.needs_snapshot = True  # if it comes back, its blocks are read afresh
        self._retiring[address] = (w, time.monotonic())
        return True

    async def start(self) -> None:
        await self.poll_once()
        self._task = asyncio.create_task(self._poll_forever())

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
        for task, _ in self._polls.values():
            task.cancel()
        for w in [*self.workers, *(w for w, _ in self._retiring.values())]:
            await w.channel.close()
        self._retiring.clear()

    async def wait_healthy(self, timeout_s: float) -> bool:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while loop.time() < end:
            if all(w.healthy for w in self.workers):
                return True
            await asyncio.sleep(0.1)
            await self.poll_once()
        return all(w.healthy for w in self.workers)

    async def wait_any_healthy(self, timeout_s: float) -> bool:
        """Until one member is routable (at once for a pool without members): enough to
        serve. The others join when their polls succeed."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while self.workers and not self.routable():
            if loop.time() >= end:
                return False
            await asyncio.sleep(0.1)
            await self.poll_once()
        return True

    def mark_failed(self, worker: WorkerHandle) -> None:
        """A call to the worker failed with UNAVAILABLE: stop using it until a poll succeeds."""
        if worker.healthy:
            log.warning("%s worker %s unavailable; out of the pool", self.role, worker.address)
        worker.set_healthy(False)
        self._forget_blocks(worker)

    def mark_draining(self, worker: WorkerHandle) -> None:
        """The worker refused a call because it drains: send it nothing new. It stays in its
        pool (what it runs finishes there); its next poll confirms it."""
        if not worker.draining:
            log.info("%s worker %s drains; no new work to it", self.role, worker.address)
        worker.draining = True

    async def poll_once(self) -> None:
        retiring = [w for w, _ in self._retiring.values()]
        await asyncio.gather(*(self._poll(w, True) for w in self.workers),
                             *(self._poll(w, False) for w in retiring))

    async def _poll_forever(self) -> None:
        tick = min(self.period_s, self.heartbeat_timeout_s) / 2
        # A tick this late means this process did not run (starved of CPU, a long pause):
        # the answers that came meanwhile wait unread, so that time is nobody's silence.
        stalled = tick + self.heartbeat_timeout_s / 4
        last = self._watching_since = time.monotonic()
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), tick)
            woken, now = self._wake.is_set(), time.monotonic()
            self._wake.clear()
            if now - last > stalled:
                log.warning("%s pool: the router did not run for %.1fs; its workers' "
                            "silence counts from now", self.role, now - last)
                self._watching_since, woken = now, True  # and ask everyone at once
            last = now
            self._start_polls(now, woken)
            self._expire(now)
            await self._close_retired()

    def _start_polls(self, now: float, all_now: bool) -> None:
        """One poll in flight per worker at most, started a period after the last one."""
        retiring = [w for w, _ in self._retiring.values()]
        for w, member in [*((w, True) for w in self.workers), *((w, False) for w in retiring)]:
            if self._polling(w.address):
                continue
            if all_now or now - self._polls.get(w.address, (None, 0.0))[1] >= self.period_s:
                self._polls[w.address] = (asyncio.create_task(self._poll(w, member)), now)

    def _polling(self, address: str) -> bool:
        task = self._polls.get(address, (None, 0.0))[0]
        return task is not None and not task.done()

    def _expire(self, now: float) -> None:
        """Take out the workers silent for longer than the heartbeat timeout: since their
        last answer, or since the router last resumed watching, whichever is later."""
        for w in [*self.workers, *(w for w, _ in self._retiring.values())]:
            silent = now - max(w.last_ok, self._watching_since)
            if w.healthy and silent > self.heartbeat_timeout_s:
                log.warning("%s worker %s did not answer for %.1fs; out of the pool",
                            self.role, w.address, silent)
                w.set_healthy(False)
                self._forget_blocks(w)

    async def _close_retired(self) -> None:
        now = time.monotonic()
        idle = [a for a, (w, since) in self._retiring.items()
                if w.inflight == 0 and now - since >= self.linger_s and not self._polling(a)]
        for address in idle:
            w, _ = self._retiring.pop(address)
            self._polls.pop(address, None)
            w.set_healthy(False)
            self._forget_blocks(w)  # events a poll took while it was being removed
            await w.channel.close()
            log.info("%s worker %s left the pool; channel closed", self.role, address)

    async def _poll(self, w: WorkerHandle, member: bool) -> None:
        take = member and self.events_from_stats  # a retiring worker is polled for health only
        snapshot = take and w.needs_snapshot
        # Workers answer from a snapshot, so even a busy one replies in milliseconds; a late
        # answer still counts (the heartbeat timeout, not this one, takes a worker out).
        timeout = self.heartbeat_timeout_s
        try:
            if w.info is None or not w.healthy:  # a worker back from the dead: read afresh
                w.info = await w.stub.GetInfo(worker_pb.InfoRequest(), timeout=timeout)
            request = worker_pb.StatsRequest(kv_snapshot=snapshot, take_kv_events=take)
            ended = w.ended_since_poll
            stats = await w.stub.GetStats(request, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.UNAUTHENTICATED and not w.refuses_credentials:
                w.refuses_credentials = True  # said once per streak, not every poll
                log.warning("%s worker %s refuses the router's credentials (%s): is it in "
                            "another cluster (cluster secret, CA)?", self.role, w.address,
                            exc.details())
            return  # `_expire` takes it out once its last answer is too old
        w.take_stats(stats, ended)
        w.last_ok = time.monotonic()
        w.refuses_credentials = False
        if stats.draining and not w.draining:
            log.info("%s worker %s drains (%d running, %d waiting); no new work to it",
                     self.role, w.address, stats.num_running, stats.num_waiting)
        w.draining = stats.draining
        if take:
            self._apply_kv_events(w, stats.kv_events, snapshot)
        w.polls += 1
        if not w.healthy:
            log.info("%s worker %s is healthy", self.role, w.address)
        w.set_healthy(True)

    def _forget_blocks(self, w: WorkerHandle) -> None:
        """`w` left the pool: drop its blocks if this pool feeds `prefix` (otherwise the feed's
        owner does, when the lease lapses; routing skips unhealthy workers meanwhile)."""
        if self.events_from_stats:
            self.prefix.clear_worker(w.address)

    def _apply_kv_events(self, w: WorkerHandle, data: bytes, snapshot: bool) -> None:
        if snapshot:
            self.prefix.clear_worker(w.address)
            w.needs_snapshot = False
        if not data:
            return
        try:
            events = decode_batch(data)
        except EventCodecError as exc:
            log.warning("bad KV events from %s: %s; resyncing", w.address, exc)
            w.needs_snapshot = True
            return
        for e in events:  # keyed by address: that is how the router knows its workers
            if isinstance(e, BlockStored):
                self.prefix.store(w.address, e.hashes, e.tier)
            elif isinstance(e, BlockRemoved):
                self.prefix.remove(w.address, e.hashes, e.tier)
