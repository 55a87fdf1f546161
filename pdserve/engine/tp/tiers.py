"""Host / SSD KV tiers under tensor parallelism: rank 0 decides, every rank moves its heads.

Each rank keeps its own `TierManager` over its own head slice of every block (SSD segments in
`<kv_ssd_dir>/rank<r>`). Only rank 0 has a block pool, so only rank 0 decides; `MirroredTiers`
wraps its manager behind the same API and replays each operation on the follower ranks:

    operation   rank 0                        followers                    delivery
    DEMOTE      keep an evicted block         the same block id and hash   queued
    AHEAD       copy blocks next in eviction  those not yet in their host  queued (idle: now)
    TOUCH       find_run's run stays MRU      same LRU order in host       queued
    PREFETCH    SSD → host                    SSD → host                   now
    LOAD        run → fresh device blocks     the same                     now; MIN over ranks
    FLUSH       wait for SSD writes           the same                     now; barrier
    STATS       its counters                  theirs                       now; all-gather

Queued operations ride in front of rank 0's next control message (a step, a KV expectation,
a load), and every rank handles messages in order; so a follower copies a block out before
any forward or KV receive that could overwrite it. A load answers how many leading blocks
were loaded: the minimum over ranks, so a block missing or corrupt on one rank is recomputed
on every rank. A call (LOAD, FLUSH, STATS) is a message followed by one collective that
every rank runs, so an answer needs no other channel. Each rank decides for itself whether a
demoted block needs a copy (already in its host: none), so ranks whose stores drifted apart
heal on the next demotion.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch
import torch.distributed as dist

from kv_store.block_pool import CachedBlock
from kv_store.index.events import Tier
from kv_store.tiers.manager import TierManager

log = logging.getLogger(__name__)


class TierOpKind(StrEnum):
    DEMOTE = "demote"
    AHEAD = "ahead"
    TOUCH = "touch"
    PREFETCH = "prefetch"
    LOAD = "load"
    FLUSH = "flush"
    STATS = "stats"


@dataclass(frozen=True)
class TierOp:
    """One tier operation for the followers, on the wire as a msgpack-able list."""

    kind: TierOpKind
    block_ids: tuple[int, ...] = ()
    """Device block ids (DEMOTE, AHEAD, LOAD), parallel to `hashes`."""
    hashes: tuple[bytes, ...] = ()
    tokens: tuple[tuple[int, ...], ...] = ()
    """Token ids of each block (DEMOTE, AHEAD, LOAD), parallel to `hashes`."""
    names: tuple[str, ...] = ()
    """Statistics asked for (STATS)."""

    def to_wire(self) -> list[Any]:
        return [self.kind.value, list(self.block_ids), list(self.hashes),
                [list(t) for t in self.tokens], list(self.names)]

    @classmethod
    def from_wire(cls, row: Sequence[Any]) -> TierOp:
        kind, ids, hashes, tokens, names = row
        return cls(TierOpKind(kind), tuple(int(b) for b in ids), tuple(bytes(h) for h in hashes),
                   tuple(tuple(int(x) for x in t) for t in tokens), tuple(str(n) for n in names))


def _blocks(op: TierOp) -> list[CachedBlock]:
    return [CachedBlock(b, h, t) for b, h, t in zip(op.block_ids, op.hashes, op.tokens,
                                                      strict=True)]


# -- follower side -------------------------------------------------------------------------
def apply_op(tiers: TierManager, op: TierOp) -> int:
    """Run one operation on a follower's own tiers; LOAD returns the blocks loaded."""
    if op.kind is TierOpKind.DEMOTE:
        for b in _blocks(op):
            tiers.demote(b.block_id, b.block_hash, b.token_ids)
    elif op.kind is TierOpKind.AHEAD:
        tiers.demote_ahead(_blocks(op), len(op.block_ids))
    elif op.kind is TierOpKind.TOUCH:
        tiers.touch(op.hashes)
    elif op.kind is TierOpKind.PREFETCH:
        tiers.prefetch(op.hashes)
    elif op.kind is TierOpKind.LOAD:
        return tiers.load(op.block_ids, op.hashes, op.tokens)
    elif op.kind is TierOpKind.FLUSH:
        tiers.flush()
    return 0


def follow(tiers: TierManager | None, control, msg: dict) -> None:
    """A follower's handling of any control message: the queued operations first, then an
    `op: tier` call answered in the collective rank 0 runs for it."""
    queued = msg.get("tier_ops") or ()
    call = msg.get("call") if msg.get("op") == "tier" else None
    if tiers is None:
        if queued or call:
            raise RuntimeError("rank 0 sent KV tier operations; this rank has no tiers")
        return
    for row in queued:
        apply_op(tiers, TierOp.from_wire(row))
    if call is None:
        return
    op = TierOp.from_wire(call)
    if op.kind is TierOpKind.LOAD:
        try:
            loaded = apply_op(tiers, op)
        except Exception:  # noqa: BLE001 - answer 0 rather than leave rank 0 in the reduce
            log.exception("KV tier load failed on this rank")
            loaded = 0
        reduce_min(control, loaded)
    elif op.kind is TierOpKind.STATS:
        stats = tiers.stats()
        gather_floats(control, [stats.get(n, 0.0) for n in op.names])
    else:
        apply_op(tiers, op)
        control.barrier().wait()


def reduce_min(control, value: int) -> int:
    """The minimum of `value` over the control group (every rank calls it)."""
    t = torch.tensor([value], dtype=torch.int64)
    control.allreduce([t], dist.ReduceOp.MIN).wait()
    return int(t.item())


def gather_floats(control, values: Sequence[float]) -> list[list[float]]:
    """Every rank's `values` (same length on all), by rank (every rank calls it)."""
    t = torch.tensor(list(values), dtype=torch.float64)
    out = [torch.empty_like(t) for _ in range(control.size())]
    control.allgather([out], [t]).wait()
    return [o.tolist() for o in out]


# -- rank 0 --------------------------------------------------------------------------------
class MirroredTiers:
    """Rank 0's tiers: `TierManager`'s API, every operation replayed on the followers."""

    def __init__(self, local: TierManager, driver) -> None:
        self.local = local
        self.driver = driver  # a TPDriver: queue_tier_op, flush_tier_ops, post, control
        self.counters: dict[str, float] = {}

    # What tests, tools and the engine read on rank 0 (rank 0's own stores and speeds).
    @property
    def host(self):
        return self.local.host

    @property
    def ssd(self):
        return self.local.ssd

    @property
    def bandwidth(self):
        return self.local.bandwidth

    @bandwidth.setter
    def bandwidth(self, model) -> None:
        self.local.bandwidth = model

    def demote(self, block_id: int, block_hash: bytes, token_ids: Sequence[int]) -> None:
        self.local.demote(block_id, block_hash, token_ids)
        self.driver.queue_tier_op(TierOp(TierOpKind.DEMOTE, (block_id,), (block_hash,),
                                         (tuple(token_ids),)).to_wire())

    def ahead_window(self, configured: int) -> int:
        return self.local.ahead_window(configured)

    def demote_ahead(self, blocks: Sequence[CachedBlock], max_blocks: int) -> list[CachedBlock]:
        done = self.local.demote_ahead(blocks, max_blocks)
        if done:
            self.driver.queue_tier_op(TierOp(
                TierOpKind.AHEAD, tuple(b.block_id for b in done),
                tuple(b.block_hash for b in done), tuple(b.token_ids for b in done)).to_wire())
        return done

    def find_run(self, hashes: Sequence[bytes], tokens: Sequence[Sequence[int]]) -> list[Tier]:
        """Rank 0's view of the run; the followers protect the same blocks in their host LRU
        (a block another rank lacks is caught by the MIN of `load`)."""
        run = self.local.find_run(hashes, tokens)
        if run:
            self.driver.queue_tier_op(
                TierOp(TierOpKind.TOUCH, hashes=tuple(hashes[:len(run)])).to_wire())
        return run

    def plan(self, run: Sequence[Tier]) -> int:
        return self.local.plan(run)

    def load(self, block_ids: Sequence[int], hashes: Sequence[bytes],
             tokens: Sequence[Sequence[int]]) -> int:
        """Load on every rank; returns the leading blocks loaded on all of them."""
        op = TierOp(TierOpKind.LOAD, tuple(block_ids), tuple(hashes),
                    tuple(tuple(t) for t in tokens))
        self.driver.post({"op": "tier", "call": op.to_wire()})
        try:
            mine, error = self.local.load(block_ids, hashes, tokens), None
        except BaseException as exc:  # still join the reduce, or the followers would hang
            mine, error = 0, exc
        n = reduce_min(self.driver.control, mine)
        if error is not None:
            raise error
        if n < mine:
            self._count("kv_tier_load_cut_by_peer", mine - n)
        return n

    def stage(self, hashes: Sequence[bytes], tokens: Sequence[Sequence[int]]
              ) -> frozenset[bytes]:
        """Rank 0 decides what to stage; the followers start reading the same blocks (their
        loads later find them in host, or read them synchronously: same result either way)."""
        waiting = self.local.stage(hashes, tokens)
        if waiting:
            self.driver.queue_tier_op(
                TierOp(TierOpKind.PREFETCH, hashes=tuple(waiting)).to_wire())
            self.driver.flush_tier_ops()
        return waiting

    def pending(self, hashes: frozenset[bytes]) -> bool:
        return self.local.pending(hashes)

    def prefetch(self, hashes: Sequence[bytes]) -> int:
        started = self.local.prefetch(hashes)
        if self.local.ssd is None or self.local.host is None:
            return started  # nothing to promote on any rank (every rank has the same tiers)
        self.driver.queue_tier_op(TierOp(TierOpKind.PREFETCH, hashes=tuple(hashes)).to_wire())
        self.driver.flush_tier_ops()  # a hint is worth most when it arrives early
        return started

    def observe_forward(self, chunks: Sequence, logits, t0: float) -> None:
        self.local.observe_forward(chunks, logits, t0)

    def stats(self) -> dict[str, float]:
        out = self.local.stats()
        out.update(self.counters)
        out.setdefault("kv_tier_load_cut_by_peer", 0.0)
        return out

    def flush(self) -> None:
        """Wait for background SSD writes on every rank."""
        self.driver.post({"op": "tier", "call": TierOp(TierOpKind.FLUSH).to_wire()})
        self.local.flush()
        self.driver.control.barrier().wait()

    def rank_stats(self, names: Sequence[str]) -> list[dict[str, float]]:
        """The named tier statistics of every rank, by rank (tests, diagnostics)."""
        names = tuple(names)
        self.driver.post({"op": "tier", "call": TierOp(TierOpKind.STATS, names=names).to_wire()})
        stats = self.local.stats()
        rows = gather_floats(self.driver.control, [stats.get(n, 0.0) for n in names])
        return [dict(zip(names, row, strict=True)) for row in rows]

    def close(self) -> None:
        """Rank 0's stores only: each follower closes its own when it stops."""
        self.local.close()

    def _count(self, name: str, value: float = 1.0) -> None:
        self.counters[name] = self.counters.get(name, 0.0) + value
