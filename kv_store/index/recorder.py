"""Worker side: turns block-pool callbacks into index events and keeps the worker's block set.

The engine thread calls `on_block_event` (the `BlockPool(on_event=...)` callback) or
`stored`/`removed` for other tiers; the worker's asyncio loop periodically publishes `drain()`
and hands `snapshot` to `KVIndex.register`. Both run under one lock, so a snapshot always
matches the events drained after it (events drained later that predate the snapshot are
harmless: replaying them gives the same state).
"""

from __future__ import annotations

import threading

from kv_store.block_pool import BlockEvent
from kv_store.index.events import BlockRemoved, BlockStored, Event, Tier, check_worker_id


class BlockRecorder:
    """Thread-safe buffer of one worker's block changes plus its current blocks per tier."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = check_worker_id(worker_id)
        self._lock = threading.Lock()
        self._held: dict[Tier, set[bytes]] = {t: set() for t in Tier}
        # Unbounded on purpose: the worker loop drains it every few ms, and the publisher
        # behind it bounds its own backlog (resyncing from `snapshot` when it overflows).
        self._pending: list[tuple[bool, bytes, Tier]] = []

    def on_block_event(self, event: BlockEvent, tier: Tier = Tier.DEVICE) -> None:
        """`BlockPool` callback: "stored"/"removed" of one hash in `tier`."""
        if event.kind == "stored":
            self.stored(event.block_hash, tier)
        elif event.kind == "removed":
            self.removed(event.block_hash, tier)
        else:
            raise ValueError(f"BlockEvent.kind must be 'stored' or 'removed', got {event.kind!r}")

    def stored(self, block_hash: bytes, tier: Tier) -> None:
        with self._lock:
            self._held[tier].add(block_hash)
            self._pending.append((True, block_hash, tier))

    def removed(self, block_hash: bytes, tier: Tier) -> None:
        with self._lock:
            self._held[tier].discard(block_hash)
            self._pending.append((False, block_hash, tier))

    def drain(self) -> list[Event]:
        """Changes since the last drain, in order, as batched events."""
        with self._lock:
            pending, self._pending = self._pending, []
        out: list[Event] = []
        run: list[bytes] = []
        key: tuple[bool, Tier] | None = None
        for stored, h, tier in pending:
            if (stored, tier) != key:
                if key is not None:
                    out.append(_event(self.worker_id, key, run))
                key, run = (stored, tier), []
            run.append(h)
        if key is not None:
            out.append(_event(self.worker_id, key, run))
        return out

    def snapshot(self) -> dict[Tier, list[bytes]]:
        """Every block this worker holds now, per tier (the `snapshot` callback of register)."""
        with self._lock:
            return {t: list(hs) for t, hs in self._held.items() if hs}


def _event(worker_id: str, key: tuple[bool, Tier], hashes: list[bytes]) -> Event:
    stored, tier = key
    return (BlockStored if stored else BlockRemoved)(worker_id, hashes, tier)
