"""Events of the cluster KV index and their wire codec (versioned msgpack, never pickle).

Workers describe changes to their caches with four events; routers fold them into a
`PrefixIndex`:

    WorkerRegistered(w)       w (re)joined: forget every block known for w; w's full block set
                              follows as BlockStored events (a snapshot), then live changes.
    BlockStored(w, hs, t)     w now holds the blocks hs in tier t (possibly also in other tiers).
    BlockRemoved(w, hs, t)    w no longer holds hs in tier t; with t = None, in no tier at all.
    WorkerGone(w)             w left cleanly: drop it and all its blocks.

Facts are per tier: each tier (device pool, host store, SSD store) reports its own blocks, so a
demotion device → host is `BlockStored(host)` followed by `BlockRemoved(device)` and no component
has to know about the other tiers. A block is gone from a worker once no tier holds it.

Replaying an ordered run of events on a state that already reflects some of them gives the same
state (the last event on a hash decides), which is what lets workers re-send a snapshot and
routers re-read a stream without double counting.

One wire message (a "batch") carries many events, each with many hashes; the hashes of an event
travel as one byte string (16 bytes per hash) rather than a list, which is smaller and faster.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import msgpack

from pdserve.block_hash import HASH_BYTES

VERSION = 1
# Wire version history (bump on any incompatible change of the batch layout, kinds or fields):
#   1 — first version: {"v", "events": [{"k": kind, "w": worker id, ...}]}; kinds
#       registered/gone/stored/removed; hashes concatenated in "h"; tier names in "t".

MAX_HASHES_PER_EVENT = 1 << 16
"""Largest number of hashes one decoded event may carry (guards against corrupt input)."""

_WORKER_ID = re.compile(r"[A-Za-z0-9_.:@/\-\[\]]{1,200}")


class Tier(IntEnum):
    """Where a worker holds a block; a larger value is a slower tier."""

    DEVICE = 0
    HOST = 1
    SSD = 2

    @property
    def wire_name(self) -> str:
        return self.name.lower()

    @classmethod
    def from_wire(cls, name: object) -> Tier:
        for tier in cls:
            if tier.wire_name == name:
                return tier
        raise EventCodecError(f"field 't': unknown tier {name!r}")


class EventCodecError(ValueError):
    """A batch this side cannot accept: undecodable, foreign version or a malformed field."""


def check_worker_id(worker_id: object) -> str:
    """Validate a worker id (it becomes part of Redis keys); returns it."""
    if not isinstance(worker_id, str) or not _WORKER_ID.fullmatch(worker_id):
        raise ValueError(
            f"worker_id must be 1-200 characters of [A-Za-z0-9_.:@/-[]], got {worker_id!r}")
    return worker_id


def _check_hashes(hashes: Iterable[bytes]) -> tuple[bytes, ...]:
    out = tuple(hashes)
    for h in out:
        if not isinstance(h, bytes) or len(h) != HASH_BYTES:
            raise ValueError(f"hashes must be {HASH_BYTES}-byte block hashes, got {h!r}")
    return out


@dataclass(frozen=True)
class BlockStored:
    """`worker_id` now holds `hashes` in `tier`."""

    worker_id: str
    hashes: tuple[bytes, ...]
    tier: Tier = Tier.DEVICE

    def __post_init__(self) -> None:
        check_worker_id(self.worker_id)
        object.__setattr__(self, "hashes", _check_hashes(self.hashes))
        object.__setattr__(self, "tier", Tier(self.tier))


@dataclass(frozen=True)
class BlockRemoved:
    """`worker_id` no longer holds `hashes` in `tier` (None: in no tier at all)."""

    worker_id: str
    hashes: tuple[bytes, ...]
    tier: Tier | None = Tier.DEVICE

    def __post_init__(self) -> None:
        check_worker_id(self.worker_id)
        object.__setattr__(self, "hashes", _check_hashes(self.hashes))
        if self.tier is not None:
            object.__setattr__(self, "tier", Tier(self.tier))


@dataclass(frozen=True)
class WorkerRegistered:
    """`worker_id` (re)joined with a lease of `ttl_s`; its previously known blocks are void."""

    worker_id: str
    info: Mapping[str, Any] = field(default_factory=dict)
    ttl_s: float = 10.0

    def __post_init__(self) -> None:
        check_worker_id(self.worker_id)
        if not isinstance(self.info, Mapping) or not all(isinstance(k, str) for k in self.info):
            raise ValueError(f"info must be a dict with str keys, got {self.info!r}")
        if not isinstance(self.ttl_s, int | float) or not self.ttl_s > 0:
            raise ValueError(f"ttl_s must be a positive number of seconds, got {self.ttl_s!r}")


@dataclass(frozen=True)
class WorkerGone:
    """`worker_id` left on purpose (unregister); its blocks are dropped at once."""

    worker_id: str
    reason: str = ""

    def __post_init__(self) -> None:
        check_worker_id(self.worker_id)


Event = BlockStored | BlockRemoved | WorkerRegistered | WorkerGone
BlockEventT = BlockStored | BlockRemoved


# -- encoding ------------------------------------------------------------------------------
def encode_batch(events: Sequence[Event]) -> bytes:
    """One wire message holding `events` in order."""
    docs = [_encode_event(e) for e in events]
    try:
        return msgpack.packb({"v": VERSION, "events": docs}, use_bin_type=True)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"info is not msgpack-serialisable: {exc}") from exc


def _encode_event(e: Event) -> dict[str, Any]:
    if isinstance(e, BlockStored | BlockRemoved):
        kind = "stored" if isinstance(e, BlockStored) else "removed"
        tier = None if e.tier is None else e.tier.wire_name
        return {"k": kind, "w": e.worker_id, "h": b"".join(e.hashes), "t": tier}
    if isinstance(e, WorkerRegistered):
        return {"k": "registered", "w": e.worker_id, "info": dict(e.info), "ttl": e.ttl_s}
    if isinstance(e, WorkerGone):
        return {"k": "gone", "w": e.worker_id, "reason": e.reason}
    raise TypeError(f"not an index event: {e!r}")


def decode_batch(data: bytes) -> list[Event]:
    """Inverse of `encode_batch`; `EventCodecError` names what is wrong."""
    try:
        doc = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError,
            msgpack.StackError) as exc:
        raise EventCodecError(f"undecodable event batch: {exc}") from exc
    if not isinstance(doc, dict):
        raise EventCodecError("event batch is not a map")
    if doc.get("v") != VERSION:
        raise EventCodecError(
            f"field 'v': unsupported event version {doc.get('v')!r} (this side speaks {VERSION})")
    items = doc.get("events")
    if not isinstance(items, list):
        raise EventCodecError("field 'events' is not a list")
    try:
        return [_decode_event(item) for item in items]
    except EventCodecError:
        raise
    except (ValueError, TypeError) as exc:
        raise EventCodecError(f"malformed event: {exc}") from exc


def _decode_event(item: object) -> Event:
    if not isinstance(item, dict):
        raise EventCodecError("event is not a map")
    kind, worker = item.get("k"), item.get("w")
    if kind in ("stored", "removed"):
        hashes = _split_hashes(item.get("h"))
        tier = item.get("t")
        if kind == "stored":
            return BlockStored(worker, hashes, Tier.from_wire(tier))
        return BlockRemoved(worker, hashes, None if tier is None else Tier.from_wire(tier))
    if kind == "registered":
        return WorkerRegistered(worker, item.get("info"), item.get("ttl"))
    if kind == "gone":
        return WorkerGone(worker, str(item.get("reason", "")))
    raise EventCodecError(f"field 'k': unknown event kind {kind!r}")


def _split_hashes(blob: object) -> list[bytes]:
    if not isinstance(blob, bytes) or len(blob) % HASH_BYTES:
        raise EventCodecError(f"field 'h' is not a whole number of {HASH_BYTES}-byte hashes")
    n = len(blob) // HASH_BYTES
    if n > MAX_HASHES_PER_EVENT:
        raise EventCodecError(f"field 'h' carries {n} hashes (at most {MAX_HASHES_PER_EVENT})")
    return [blob[i:i + HASH_BYTES] for i in range(0, len(blob), HASH_BYTES)]


# -- batching ------------------------------------------------------------------------------
def coalesce(events: Iterable[Event], max_hashes: int = 4096) -> list[Event]:
    """Merge consecutive block events of the same worker, kind and tier (order is kept) into
    events of at most `max_hashes` hashes each."""
    out: list[Event] = []
    run_key: tuple | None = None
    run: list[bytes] = []

    def close_run() -> None:
        if run_key is not None:
            cls, worker, tier = run_key
            out.extend(cls(worker, run[i:i + max_hashes], tier)
                       for i in range(0, len(run), max_hashes))

    for e in events:
        if isinstance(e, BlockStored | BlockRemoved):
            key = (type(e), e.worker_id, e.tier)
            if key != run_key:
                close_run()
                run_key, run = key, []
            run.extend(e.hashes)
        else:
            close_run()
            run_key, run = None, []
            out.append(e)
    close_run()
    return out


def pack_batches(events: Sequence[Event], max_hashes: int = 4096) -> list[bytes]:
    """Wire messages for `events` in order, each carrying at most about `max_hashes` hashes."""
    out: list[bytes] = []
    batch: list[Event] = []
    size = 0
    for e in coalesce(events, max_hashes):
        n = len(e.hashes) if isinstance(e, BlockStored | BlockRemoved) else 1
        if batch and size + n > max_hashes:
            out.append(encode_batch(batch))
            batch, size = [], 0
        batch.append(e)
        size += n
    if batch:
        out.append(encode_batch(batch))
    return out
