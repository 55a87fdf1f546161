"""The tier manager: moves whole blocks between the device cache and the host / SSD stores.

    demote  (device pool evicts a cached block)  device ─copy─► host   (host full: LRU ─► SSD)
    demote ahead (between steps)  the next blocks in eviction order ─copy─► host, kept on the
            device too, so their eviction later finds them in host and copies nothing
    stage   (a waiting request's run reaches SSD)  SSD ─► host in the background, the whole
            run submitted at once (adjacent records in one read, read ahead); the request
            waits for its own reads while the rest of the batch keeps running
    promote (prefix lookup continues past device hits)  host | SSD ─copy─► fresh device blocks
    prefetch (hint from the router)                     SSD ─► host, in the background

A block here is every layer of one paged block, as opaque bytes (so the FP8 layout needs
nothing special). Each move is timed: reads feed `BandwidthModel`, forward passes feed the
prefill speed, and `plan_load` decides per run whether loading beats recomputing.

On CUDA, device↔host copies are issued non-blocking on the current stream, so a promotion is
ordered before the forward that uses it without a host-side wait; the host waits only before
the CPU itself touches a slot a copy may still be writing (SSD demotion, SSD→host fills).
Every method is called on the engine thread. SSD reads complete on I/O threads, whose callbacks
only queue the bytes (`_landed`): the engine thread moves them into the host store at its next
call (`_absorb`), so the host store is never touched from two threads.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kv_store.block_pool import BlockEvent, CachedBlock
from kv_store.index.events import Tier
from kv_store.tiers.host import HostStore
from kv_store.tiers.policy import BandwidthModel, demote_ahead_window, plan_load
from kv_store.tiers.ssd import SSDStore

if TYPE_CHECKING:
    from pdserve.engine.kv_layout import KVLayout

TierEventFn = Callable[[BlockEvent, Tier], None]
GB = 2**30


class TierManager:
    def __init__(self, caches: Sequence[torch.Tensor], block_size: int,
                 host_bytes: int = 0, ssd_dir: str | None = None, ssd_bytes: int = 0,
                 on_event: TierEventFn | None = None, ssd_persist: bool = False) -> None:
        self.caches = list(caches)
        self.block_size = block_size
        self._layer_bytes = [c[0].numel() * c.element_size() for c in self.caches]
        self.block_bytes = sum(self._layer_bytes)
        self._cuda = self.caches[0].is_cuda
        self._on_event = on_event
        self._lock = threading.Lock()
        self.counters: dict[str, float] = {}
        self.bandwidth = BandwidthModel()
        self._last_copy: torch.cuda.Event | None = None
        self._pending_timing: tuple[int, float, torch.cuda.Event] | None = None
        # SSD → host reads in flight (engine thread), and what they returned (I/O threads
        # append, the engine thread pops): (hash, tokens, bytes or None, completion time).
        self._inflight: dict[bytes, threading.Event] = {}  # set once its bytes are queued
        self._landed: deque[tuple[bytes, tuple[int, ...], memoryview | None, float]] = deque()
        self._batches: list[_ReadBatch] = []  # staged reads, timed as one for the SSD speed
        self.ssd = None
        if ssd_dir is not None and ssd_bytes > 0:
            self.ssd = SSDStore(ssd_dir, ssd_bytes, self.block_bytes, block_size,
                                notify=self._ssd_notify, persist=ssd_persist)
        self.host = None
        if host_bytes > 0:
            self.host = HostStore(host_bytes, self.block_bytes, pin=self._cuda,
                                  on_evict=self._host_evicted)

    @classmethod
    def create(cls, caches: Sequence[torch.Tensor], layout: KVLayout, tp_size: int,
               host_gb: float, ssd_dir: str | None, ssd_gb: float,
               on_event: TierEventFn | None = None,
               ssd_persist: bool = False) -> TierManager | None:
        """A manager for the configured tiers over an engine's caches (of `layout` on a rank
        of a group of `tp_size`: a slot holds `layout.block_bytes(tp_size)`), or None when
        neither tier is configured."""
        if host_gb <= 0 and (ssd_dir is None or ssd_gb <= 0):
            return None
        layout.check_caches(caches, tp_size)
        tiers = cls(caches, layout.block_size, int(host_gb * GB), ssd_dir, int(ssd_gb * GB),
                    on_event, ssd_persist)
        assert tiers.block_bytes == layout.block_bytes(tp_size)
        return tiers

    # -- demotion (device → host → SSD) --------------------------------------------------
    def demote(self, block_id: int, block_hash: bytes, token_ids: Sequence[int]) -> None:
        """`BlockPool` eviction hook: keep the block's bytes before the device slot is reused.
        A block already in host (demoted ahead) is only marked most recently used there."""
        if self.host is not None:
            if self.host.put_with(block_hash, token_ids, lambda s: self._d2h(block_id, s)):
                self._count("kv_tier_host_bytes_in", self.block_bytes)
                self._count("kv_tier_demote_copies")
                self._publish("stored", block_hash, Tier.HOST)
            else:
                self._count("kv_tier_demote_found_in_host")
        elif self.ssd is not None and block_hash not in self.ssd:
            slot = torch.empty(self.block_bytes, dtype=torch.uint8)
            self._d2h(block_id, slot)
            self._sync_copies()
            self._ssd_write(block_hash, token_ids, slot)

    def ahead_window(self, configured: int) -> int:
        """How many of the next blocks in eviction order `demote_ahead` may look at."""
        return 0 if self.host is None else demote_ahead_window(configured, self.host.num_slots)

    def demote_ahead(self, blocks: Sequence[CachedBlock], max_blocks: int) -> list[CachedBlock]:
        """Copy up to `max_blocks` of `blocks` (cached-free device blocks, next in line for
        eviction) to the host tier now, leaving them on the device; skips blocks already in
        host. Returns the blocks copied. Their eviction later costs no copy (see `demote`)."""
        done: list[CachedBlock] = []
        if self.host is None:
            return done
        for b in blocks:
            if len(done) >= max_blocks:
                break
            if b.block_hash in self.host:
                continue
            if self.host.put_with(b.block_hash, b.token_ids,
                                  lambda s, i=b.block_id: self._d2h(i, s)):
                done.append(b)
                self._publish("stored", b.block_hash, Tier.HOST)
        self._count("kv_tier_demoted_ahead", len(done))
        self._count("kv_tier_host_bytes_in", len(done) * self.block_bytes)
        return done

    def touch(self, hashes: Sequence[bytes]) -> None:
        """Mark host blocks most recently used, in order (absent ones are skipped)."""
        if self.host is not None:
            for h in hashes:
                self.host.touch(h)

    def _host_evicted(self, block_hash: bytes, tokens: tuple[int, ...],
                      slot: torch.Tensor) -> None:
        self._publish("removed", block_hash, Tier.HOST)
        if self.ssd is not None and block_hash not in self.ssd:
            self._sync_copies()  # the slot may still be the target of a device copy
            self._ssd_write(block_hash, tokens, slot)

    def _ssd_write(self, block_hash: bytes, tokens: Sequence[int], data: torch.Tensor) -> None:
        assert self.ssd is not None
        self.ssd.write(block_hash, tokens, data.numpy().tobytes())
        self._count("kv_tier_ssd_bytes_in", self.block_bytes)

    # -- promotion (host / SSD → device) -------------------------------------------------
    def find_run(self, hashes: Sequence[bytes], tokens: Sequence[Sequence[int]],
                 touch: bool = True) -> list[Tier]:
        """Tiers of the leading blocks found below the device (stops at the first miss)."""
        self._absorb()
        run: list[Tier] = []
        for h, t in zip(hashes, tokens, strict=True):
            if self.host is not None and self.host.has(h, t):
                if touch:
                    self.host.touch(h)  # keep it through the allocation before its load
                run.append(Tier.HOST)
            elif self.ssd is not None and self.ssd.has(h, t):
                run.append(Tier.SSD)
            else:
                break
        return run

    def plan(self, run: Sequence[Tier]) -> int:
        """How many leading blocks of `run` to load (the rest are recomputed)."""
        self._harvest_timings()
        k = plan_load(run, self.block_bytes, self.block_size, self.bandwidth.bandwidth(),
                      self.bandwidth.prefill_tps)
        self._count("kv_tier_blocks_loaded_planned", k)
        self._count("kv_tier_blocks_recompute_chosen", len(run) - k)
        return k

    def load(self, block_ids: Sequence[int], hashes: Sequence[bytes],
             tokens: Sequence[Sequence[int]]) -> int:
        """Copy blocks into device blocks `block_ids`, in order; returns how many leading
        blocks were loaded (a block that vanished or failed its checksum ends the run)."""
        self._await_inflight(hashes)
        ssd_reads = {}
        if self.ssd is not None:  # the run's SSD blocks in flight at once, adjacent ones as one
            at = [i for i, (h, t) in enumerate(zip(hashes, tokens, strict=True))
                  if not (self.host is not None and self.host.has(h, t))]
            futs = self.ssd.read_many([(hashes[i], tokens[i]) for i in at])
            ssd_reads = dict(zip(at, futs, strict=True))
        t0 = time.perf_counter()
        n = self._load_run(block_ids, hashes, tokens, ssd_reads)
        n_ssd = sum(1 for i in ssd_reads if i < n)
        # SSD reads overlap each other: one sample of all their bytes over the whole run.
        self._record_read(Tier.SSD, n_ssd * self.block_bytes, time.perf_counter() - t0)
        return n

    def _load_run(self, block_ids, hashes, tokens, ssd_reads: dict) -> int:
        host_bytes, host_t0 = 0, time.perf_counter()
        for i, (b, h, t) in enumerate(zip(block_ids, hashes, tokens, strict=True)):
            if i in ssd_reads:
                if not self._load_from_ssd(b, ssd_reads[i]):
                    self._count("kv_tier_ssd_load_failures")
                    self._cancel(ssd_reads, i + 1)
                    return i
            elif self.host is not None and self.host.read(h, t, lambda s, b=b: self._h2d(s, b)):
                host_bytes += self.block_bytes
                self._count("kv_tier_host_hits")
            else:
                self._cancel(ssd_reads, i + 1)
                return i
        if not ssd_reads:
            self._time_host(host_bytes, host_t0)
        return len(block_ids)

    def _load_from_ssd(self, block_id: int, fut) -> bool:
        data = fut.result()
        if data is None:
            return False
        self._h2d(torch.frombuffer(data, dtype=torch.uint8), block_id)
        self._count("kv_tier_ssd_hits")
        self._count("kv_tier_ssd_bytes_out", self.block_bytes)
        return True

    def _cancel(self, reads: dict, start: int) -> None:
        for i, fut in reads.items():
            if i >= start:
                fut.cancel()

    # -- staging and prefetch (SSD → host, in the background) ----------------------------
    def stage(self, hashes: Sequence[bytes], tokens: Sequence[Sequence[int]]) -> frozenset[bytes]:
        """Start SSD → host reads of the SSD blocks in the leading run worth loading; returns
        the hashes still in flight, which the caller's request should wait for (empty: load
        now). Without a host tier there is nowhere to stage: empty."""
        if self.ssd is None or self.host is None:
            return frozenset()
        run = self.find_run(hashes, tokens, touch=False)
        k = plan_load(run, self.block_bytes, self.block_size, self.bandwidth.bandwidth(),
                      self.bandwidth.prefill_tps)
        wanted = [h for h, tier in zip(hashes[:k], run[:k], strict=True) if tier is Tier.SSD]
        started = self._start_reads(wanted)
        if started:
            self._batches.append(_ReadBatch(time.perf_counter(), set(started)))
            self._count("kv_tier_staged_blocks", len(started))
        return frozenset(h for h in wanted if h in self._inflight)

    def pending(self, hashes: frozenset[bytes]) -> bool:
        """True while any of these staged reads is still in flight."""
        self._absorb()
        return any(h in self._inflight for h in hashes)

    def prefetch(self, hashes: Sequence[bytes]) -> int:
        """Start SSD → host promotion of the listed blocks not already in host memory;
        returns how many were started (they land in the host tier asynchronously)."""
        if self.ssd is None or self.host is None:
            return 0
        self._absorb()
        started = len(self._start_reads([h for h in hashes if h not in self.host]))
        self._count("kv_tier_prefetch_started", started)
        return started

    def _start_reads(self, hashes: Sequence[bytes]) -> list[bytes]:
        assert self.ssd is not None
        wanted: list[tuple[bytes, tuple[int, ...]]] = []
        for h in dict.fromkeys(hashes):
            tokens = self.ssd.tokens_of(h)
            if h not in self._inflight and tokens is not None:
                wanted.append((h, tokens))
                self._inflight[h] = threading.Event()
        # One call for the whole run: its adjacent records are read together, read ahead.
        for (h, tokens), fut in zip(wanted, self.ssd.read_many(wanted), strict=True):
            landed = self._inflight[h]
            fut.add_done_callback(lambda f, h=h, t=tokens, ev=landed: self._read_done(h, t, f, ev))
        return [h for h, _ in wanted]

    def _read_done(self, block_hash: bytes, tokens: tuple[int, ...], fut,
                   landed: threading.Event) -> None:
        """I/O thread: queue what a background read returned, for the engine thread."""
        data = None if fut.cancelled() or fut.exception() else fut.result()
        self._landed.append((block_hash, tokens, data, time.perf_counter()))
        landed.set()

    def _await_inflight(self, hashes: Sequence[bytes], timeout_s: float = 10.0) -> None:
        """Wait for background reads of these blocks instead of reading them a second time
        (a follower rank told to load blocks its own staging is still reading)."""
        for h in hashes:
            ev = self._inflight.get(h)
            if ev is not None:
                ev.wait(timeout_s)
        self._absorb()

    def _absorb(self) -> None:
        """Engine thread: move the SSD reads that completed into the host store."""
        while self._landed:
            h, tokens, data, t_done = self._landed.popleft()
            self._inflight.pop(h, None)
            for b in self._batches:
                if h in b.hashes:
                    b.t_last = max(b.t_last, t_done)
            if data is not None:
                self._fill_host(h, tokens, data)
        done = [b for b in self._batches if not b.hashes & self._inflight.keys()]
        for b in done:  # staged reads overlap: one sample of all their bytes over the batch
            self._record_read(Tier.SSD, len(b.hashes) * self.block_bytes, b.t_last - b.t0)
            self._batches.remove(b)

    def _fill_host(self, block_hash: bytes, tokens: tuple[int, ...], data: memoryview) -> None:
        src = torch.frombuffer(data, dtype=torch.uint8)

        def fill(slot: torch.Tensor) -> None:
            self._sync_copies()  # an earlier device copy may still read this slot
            slot.copy_(src)

        if self.host is not None and self.host.put_with(block_hash, tokens, fill):
            self._count("kv_tier_prefetched")
            self._publish("stored", block_hash, Tier.HOST)

    # -- copies --------------------------------------------------------------------------
    def _d2h(self, block_id: int, slot: torch.Tensor) -> None:
        off = 0
        for cache, n in zip(self.caches, self._layer_bytes, strict=True):
            slot[off:off + n].copy_(cache[block_id].reshape(-1).view(torch.uint8),
                                    non_blocking=self._cuda)
            off += n
        self._mark_copy()

    def _h2d(self, slot: torch.Tensor, block_id: int) -> None:
        off = 0
        for cache, n in zip(self.caches, self._layer_bytes, strict=True):
            cache[block_id].view(-1).view(torch.uint8).copy_(slot[off:off + n],
                                                              non_blocking=self._cuda)
            off += n
        self._mark_copy()

    def _mark_copy(self) -> None:
        if self._cuda:
            self._last_copy = torch.cuda.Event()
            self._last_copy.record()

    def _sync_copies(self) -> None:
        ev = self._last_copy
        if ev is not None:
            ev.synchronize()

    # -- measurements --------------------------------------------------------------------
    def _time_host(self, nbytes: int, t0: float) -> None:
        if nbytes == 0:
            return
        self._count("kv_tier_host_bytes_out", nbytes)
        if self._cuda:
            # Completion is polled later, so the engine thread never waits for the copy.
            end = torch.cuda.Event()
            end.record()
            self._pending_timing = (nbytes, t0, end)
            return
        self._record_read(Tier.HOST, nbytes, time.perf_counter() - t0)

    def _harvest_timings(self) -> None:
        pending = self._pending_timing
        if pending is not None and pending[2].query():
            # Wall time from issue to observed completion: an upper bound of the copy time.
            self._pending_timing = None
            nbytes, t0, _ = pending
            self._record_read(Tier.HOST, nbytes, time.perf_counter() - t0)

    def _record_read(self, tier: Tier, nbytes: int, seconds: float) -> None:
        self.bandwidth.record_read(tier, nbytes, seconds)

    def observe_forward(self, chunks: Sequence, logits: torch.Tensor, t0: float) -> None:
        """Feed the prefill speed from a forward pass started at `t0` (engine thread)."""
        tokens = sum(len(c.token_ids) for c in chunks if len(c.token_ids) >= self.block_size)
        if tokens == 0:
            return  # decode-only steps say nothing about prefill speed
        if logits.is_cuda:
            torch.cuda.synchronize(logits.device)  # sampling waits for it right after anyway
        self.bandwidth.record_prefill(tokens, time.perf_counter() - t0)

    # -- events and statistics -----------------------------------------------------------
    def _publish(self, kind: str, block_hash: bytes, tier: Tier) -> None:
        if self._on_event is not None:
            self._on_event(BlockEvent(kind, block_hash), tier)

    def _ssd_notify(self, kind: str, block_hash: bytes) -> None:
        self._publish(kind, block_hash, Tier.SSD)

    def _count(self, name: str, value: float = 1.0) -> None:
        with self._lock:
            self.counters[name] = self.counters.get(name, 0.0) + value

    def stats(self) -> dict[str, float]:
        """`kv_tier_*` statistics for `LLMEngine.stats()`."""
        with self._lock:
            out = dict(self.counters)
        bw = self.bandwidth.bandwidth()
        out.update({
            "kv_tier_host_blocks": float(len(self.host)) if self.host is not None else 0.0,
            "kv_tier_host_capacity_blocks": float(self.host.num_slots) if self.host else 0.0,
            "kv_tier_ssd_blocks": float(len(self.ssd)) if self.ssd is not None else 0.0,
            "kv_tier_ssd_corrupted": float(self.ssd.num_corrupted) if self.ssd else 0.0,
            "kv_tier_host_read_bw": bw[Tier.HOST] or 0.0,
            "kv_tier_ssd_read_bw": bw[Tier.SSD] or 0.0,
            "kv_tier_prefill_tps": self.bandwidth.prefill_tps or 0.0,
        })
        return out

    def flush(self) -> None:
        """Wait for background SSD writes (tests, benchmarks, shutdown)."""
        if self.ssd is not None:
            self.ssd.flush()

    def close(self) -> None:
        if self.ssd is not None:
            self.ssd.close()


@dataclass
class _ReadBatch:
    """SSD reads started together by one `stage`, timed from start to the last landing."""

    t0: float
    hashes: set[bytes]
    t_last: float = 0.0  # when the last of them landed (I/O thread clock)


def tier_stats_off() -> dict[str, float]:
    """The `kv_tier_*` keys of an engine without lower tiers (all zero)."""
    return {"kv_tier_host_blocks": 0.0, "kv_tier_ssd_blocks": 0.0}
