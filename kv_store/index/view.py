"""A router's picture of the cluster: live workers with lease deadlines, and their blocks.

Both index implementations fold events into an `IndexView`; they differ only in where the
events and lease observations come from (a direct call, or a Redis stream and registry poll).

    unknown ──WorkerRegistered / lease seen──► live ──deadline passes / WorkerGone──► unknown
                                                                   (WorkerGone: lease sightings
                                                                    ignored for one ttl)
                                                 ▲ │
                          WorkerRegistered:      └─┘  blocks reset, lease renewed

Block events of a worker the view does not know are ignored: either the worker's lease is gone
(stale events) or its registration is still on the way, and a registration is always followed
by the worker's full block set. Deadlines use a monotonic clock passed in by the caller.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kv_store.index.events import (
    BlockRemoved,
    BlockStored,
    Event,
    WorkerGone,
    WorkerRegistered,
)
from kv_store.index.prefix import PrefixIndex


@dataclass
class Lease:
    info: dict[str, Any]
    ttl_s: float
    deadline: float


class IndexView:
    """Live workers and the `PrefixIndex` of their blocks. Not thread-safe."""

    def __init__(self) -> None:
        self.prefix = PrefixIndex()
        self._leases: dict[str, Lease] = {}
        # Workers that left cleanly, until their old lease would have lapsed: a registry read
        # racing with the unregister must not bring them back.
        self._gone: dict[str, float] = {}
        self.ignored_events = 0
        """Block events dropped because their worker was not known (stale or early)."""

    def workers(self) -> dict[str, dict[str, Any]]:
        return {w: dict(lease.info) for w, lease in self._leases.items()}

    def lease(self, worker_id: str) -> Lease | None:
        return self._leases.get(worker_id)

    def apply(self, events: Iterable[Event], now: float) -> None:
        for e in events:
            if isinstance(e, BlockStored | BlockRemoved):
                if e.worker_id not in self._leases:
                    self.ignored_events += 1
                elif isinstance(e, BlockStored):
                    self.prefix.store(e.worker_id, e.hashes, e.tier)
                else:
                    self.prefix.remove(e.worker_id, e.hashes, e.tier)
            elif isinstance(e, WorkerRegistered):
                self._gone.pop(e.worker_id, None)
                self._leases[e.worker_id] = Lease(dict(e.info), e.ttl_s, now + e.ttl_s)
                self.prefix.add_worker(e.worker_id)
                self.prefix.clear_worker(e.worker_id)
            elif isinstance(e, WorkerGone):
                lease = self._leases.get(e.worker_id)
                self._gone[e.worker_id] = now + (lease.ttl_s if lease else 0.0)
                self.drop(e.worker_id)

    def observe_lease(self, worker_id: str, info: Mapping[str, Any], ttl_s: float,
                      remaining_s: float, now: float) -> None:
        """The registry shows `worker_id`'s lease with `remaining_s` left."""
        if self._gone.get(worker_id, -1.0) >= now:
            return
        lease = self._leases.get(worker_id)
        if lease is None:
            self._leases[worker_id] = Lease(dict(info), ttl_s, now + remaining_s)
            self.prefix.add_worker(worker_id)
        else:
            lease.info, lease.ttl_s = dict(info), ttl_s
            lease.deadline = max(lease.deadline, now + remaining_s)

    def renew(self, worker_id: str, now: float) -> bool:
        """Extend a live lease by its ttl; False when the worker is not live."""
        lease = self._leases.get(worker_id)
        if lease is None or lease.deadline < now:
            return False
        lease.deadline = now + lease.ttl_s
        return True

    def extend_all(self, now: float) -> None:
        """Give every known worker a full lease from `now` (after an outage of the registry,
        during which nobody could renew, workers get one lease period to re-register)."""
        for lease in self._leases.values():
            lease.deadline = max(lease.deadline, now + lease.ttl_s)

    def expire(self, now: float) -> list[str]:
        """Drop workers whose lease deadline has passed; returns their ids."""
        gone = [w for w, lease in self._leases.items() if lease.deadline < now]
        for w in gone:
            self.drop(w)
        self._gone = {w: t for w, t in self._gone.items() if t >= now}
        return gone

    def drop(self, worker_id: str) -> None:
        self._leases.pop(worker_id, None)
        self.prefix.drop_worker(worker_id)
