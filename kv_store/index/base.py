"""The KV index interface: one API for the in-process and the Redis implementation.

Workers register with a lease (`ttl_s`) that they keep alive with `heartbeat`, and publish
block events; routers read `workers()` and query `prefix.match(...)`. The index is a hint:
whatever it says, a worker validates every hit against its own cache (hash and token ids).

Failure contract: once `start()` has returned, no call raises because the backend is
unreachable. Worker-side calls queue their work and return; a background task delivers it and
retries. Router-side reads answer from memory (what is known, or nothing). Only programming
errors (bad arguments, an unknown worker) raise. `start()` itself raises on bad configuration
(e.g. wrong credentials), so a misconfigured process fails at startup.

After a lease was lost (expired, or the backend lost its data), the next `heartbeat`
re-registers the worker and re-publishes its full block set from its `snapshot` callback.

Call everything from one asyncio event loop (the one `start()` ran on).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

from kv_store.index.events import Event, Tier
from kv_store.index.prefix import PrefixIndex, PrefixMatch

SnapshotFn = Callable[[], Mapping[Tier, Sequence[bytes]]]
"""Returns every block the worker holds now, per tier (e.g. `BlockRecorder.snapshot`)."""


class KVIndexError(RuntimeError):
    """Base class of the index's own errors."""


class KVIndexConfigError(KVIndexError):
    """The index cannot work as configured (bad URL, credentials refused): fix and restart."""


class KVIndex(ABC):
    """Cluster-wide map of which worker holds which KV block, in which tier."""

    # -- lifecycle -----------------------------------------------------------------------
    @abstractmethod
    async def start(self) -> None:
        """Connect and start background tasks; raises `KVIndexConfigError` on bad config."""

    @abstractmethod
    async def close(self) -> None:
        """Stop background tasks (best-effort flush first). Leases are left to expire."""

    async def __aenter__(self) -> KVIndex:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    # -- worker side ---------------------------------------------------------------------
    @abstractmethod
    async def register(self, worker_id: str, info: Mapping[str, Any], ttl_s: float,
                       snapshot: SnapshotFn | None = None) -> None:
        """Announce `worker_id` with a lease of `ttl_s` seconds and its current blocks."""

    @abstractmethod
    async def heartbeat(self, worker_id: str) -> None:
        """Renew the lease (re-register and re-publish if it was lost). Call every ttl/3."""

    @abstractmethod
    async def unregister(self, worker_id: str) -> None:
        """Leave cleanly: routers drop the worker and its blocks at once."""

    @abstractmethod
    async def publish(self, events: Sequence[Event]) -> None:
        """Queue block events of registered workers (in order; batched on the way)."""

    @abstractmethod
    async def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until everything queued so far is delivered; False if not within timeout."""

    # -- router side ---------------------------------------------------------------------
    @abstractmethod
    async def workers(self) -> dict[str, dict[str, Any]]:
        """Live workers (lease not expired, as far as this process knows) → their info."""

    @property
    @abstractmethod
    def prefix(self) -> PrefixIndex:
        """The in-memory prefix index of live workers' blocks (read-only for callers)."""

    def match(self, hashes: Sequence[bytes]) -> dict[str, PrefixMatch]:
        """Leading blocks of `hashes` held by each worker (`prefix.match`)."""
        return self.prefix.match(hashes)


def check_registration(info: Mapping[str, Any], ttl_s: float) -> None:
    """Shared argument checks of `register` (clear errors naming the field)."""
    if not isinstance(info, Mapping):
        raise ValueError(f"info must be a mapping, got {type(info).__name__}")
    if not isinstance(ttl_s, int | float) or not ttl_s > 0:
        raise ValueError(f"ttl_s must be a positive number of seconds, got {ttl_s!r}")
