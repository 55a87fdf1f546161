"""The router's in-memory prefix index: which worker holds which block hash, in which tier.

Each worker gets a small integer slot; for every hash the index keeps, per tier t, the mask of
slots holding it in tier t or a faster one. `match(hashes)` walks the prompt's hashes once and
narrows three masks of workers still matching (any tier; host or better; device), so a query
costs O(len(hashes)) mask operations (a 64-worker mask is one machine word) plus O(1) per worker
dropping out, never O(workers × blocks). Chained hashes make a hit on block i imply the whole
prefix, but the walk still stops each worker at its first miss (a root block may have been
evicted before its children).

Per worker the index also keeps hash → tier bits, so removing a worker costs O(its blocks).
Pure data structure: no I/O, no clock, not thread-safe (one asyncio loop owns it).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kv_store.index.events import Tier

_TIERS = tuple(Tier)
assert len(_TIERS) == 3, "PrefixIndex.match is unrolled for three tiers"
_ALL_TIER_BITS = (1 << len(_TIERS)) - 1
_NONE = len(_TIERS)
# _FASTEST[tier bits] = index of the fastest tier present (_NONE for no tier)
_FASTEST = [next((t for t in range(_NONE) if bits >> t & 1), _NONE)
            for bits in range(_ALL_TIER_BITS + 1)]


@dataclass(frozen=True)
class PrefixMatch:
    """How much of a prompt one worker holds.

    `leading[t]` is the number of leading blocks the worker holds in tier t or a faster one, so
    it never decreases with t; `blocks` (= leading[-1]) counts leading blocks in any tier.
    """

    leading: tuple[int, ...]

    @property
    def blocks(self) -> int:
        return self.leading[-1]

    @property
    def worst_tier(self) -> Tier:
        """Slowest tier among the matched blocks (each block counted at its fastest tier)."""
        for tier in _TIERS:
            if self.leading[tier] == self.blocks:
                return tier
        raise AssertionError("unreachable: leading[-1] == blocks")

    def blocks_in(self, tier: Tier) -> int:
        """Matched blocks whose fastest tier is `tier`, counting tiers from the prompt's start:
        after the first block that is not in device memory, no block counts as device."""
        return self.leading[tier] - (self.leading[tier - 1] if tier > 0 else 0)


class PrefixIndex:
    """Hash → cumulative per-tier worker masks, and worker → hash → tier bits."""

    def __init__(self) -> None:
        # reach[h][t]: slots holding h in tier t or a faster one (so reach[h][-1]: any tier).
        self._reach: dict[bytes, list[int]] = {}
        self._held: dict[str, dict[bytes, int]] = {}
        self._slot: dict[str, int] = {}
        self._owner: list[str | None] = []
        self._free: list[int] = []

    # -- queries -------------------------------------------------------------------------
    def workers(self) -> list[str]:
        """Workers known to the index (with or without blocks)."""
        return list(self._slot)

    def num_blocks(self, worker_id: str | None = None) -> int:
        """Distinct hashes held by `worker_id` (any tier), or by anybody when None."""
        if worker_id is None:
            return len(self._reach)
        return len(self._held.get(worker_id, ()))

    def tiers_of(self, worker_id: str, block_hash: bytes) -> set[Tier]:
        bits = self._held.get(worker_id, {}).get(block_hash, 0)
        return {t for t in _TIERS if bits >> t & 1}

    def match(self, hashes: Sequence[bytes]) -> dict[str, PrefixMatch]:
        """Leading blocks of `hashes` each worker holds; workers with none are left out."""
        if not hashes or (first := self._reach.get(hashes[0])) is None:
            return {}
        # Unrolled over the three tiers: this loop is the router's hot path.
        a0, a1, a2 = first
        leading = {slot: [0, 0, 0] for slot in _bits(a2)}
        stop = len(hashes)
        get = self._reach.get
        for i in range(1, stop):
            reach = get(hashes[i])
            if reach is None:
                stop = i
                break
            k0, k1, k2 = a0 & reach[0], a1 & reach[1], a2 & reach[2]
            if k0 != a0:
                _record(leading, a0 ^ k0, 0, i)
                a0 = k0
            if k1 != a1:
                _record(leading, a1 ^ k1, 1, i)
                a1 = k1
            if k2 != a2:
                _record(leading, a2 ^ k2, 2, i)
                a2 = k2
                if not a2:
                    stop = i
                    break
        _record(leading, a0, 0, stop)
        _record(leading, a1, 1, stop)
        _record(leading, a2, 2, stop)
        return {self._owner[s]: PrefixMatch(tuple(v)) for s, v in leading.items()}

    # -- mutations -----------------------------------------------------------------------
    def add_worker(self, worker_id: str) -> None:
        """Make `worker_id` known (no blocks); idempotent."""
        if worker_id in self._slot:
            return
        slot = heapq.heappop(self._free) if self._free else len(self._owner)
        if slot == len(self._owner):
            self._owner.append(None)
        self._owner[slot] = worker_id
        self._slot[worker_id] = slot
        self._held[worker_id] = {}

    def store(self, worker_id: str, hashes: Iterable[bytes], tier: Tier) -> None:
        self.add_worker(worker_id)
        slot_bit = 1 << self._slot[worker_id]
        held = self._held[worker_id]
        tier_bit = 1 << int(tier)
        for h in hashes:
            old = held.get(h, 0)
            new = old | tier_bit
            if new == old:
                continue
            held[h] = new
            reach = self._reach.get(h)
            if reach is None:
                reach = self._reach[h] = [0, 0, 0]
            for t in range(_FASTEST[new], _FASTEST[old]):
                reach[t] |= slot_bit

    def remove(self, worker_id: str, hashes: Iterable[bytes], tier: Tier | None) -> None:
        """Drop `hashes` from `tier` of the worker (from every tier when `tier` is None)."""
        held = self._held.get(worker_id)
        if held is None:
            return
        keep = 0 if tier is None else _ALL_TIER_BITS & ~(1 << int(tier))
        slot_bit = 1 << self._slot[worker_id]
        for h in hashes:
            old = held.get(h, 0)
            new = old & keep
            if new == old:
                continue
            if new:
                held[h] = new
            else:
                del held[h]
            self._unreach(h, slot_bit, _FASTEST[old], _FASTEST[new])

    def clear_worker(self, worker_id: str) -> None:
        """Forget every block of `worker_id` but keep it known."""
        held = self._held.get(worker_id)
        if not held:
            return
        slot_bit = 1 << self._slot[worker_id]
        for h, bits in held.items():
            self._unreach(h, slot_bit, _FASTEST[bits], _NONE)
        held.clear()

    def drop_worker(self, worker_id: str) -> None:
        """Forget `worker_id` and its blocks; its slot is reused by a later worker."""
        if worker_id not in self._slot:
            return
        self.clear_worker(worker_id)
        slot = self._slot.pop(worker_id)
        del self._held[worker_id]
        self._owner[slot] = None
        heapq.heappush(self._free, slot)

    def _unreach(self, h: bytes, slot_bit: int, old_fastest: int, new_fastest: int) -> None:
        reach = self._reach[h]
        for t in range(old_fastest, new_fastest):
            reach[t] &= ~slot_bit
        if not reach[-1]:
            del self._reach[h]


def _bits(mask: int) -> Iterable[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def _record(leading: dict[int, list[int]], mask: int, tier: int, value: int) -> None:
    while mask:  # the bits of `mask`, inlined: this runs once per worker per query
        low = mask & -mask
        leading[low.bit_length() - 1][tier] = value
        mask ^= low
