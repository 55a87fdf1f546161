"""Discovery mode: the router's pools follow the worker registry (`router --redis URL` with no
`--prefill`/`--decode` lists).

    registry (KVIndex.workers(): live leases → info)
        │ every period_s
        ▼
    plan_membership (pure)  a live worker of role prefill/decode serving this model id joins
        │                   its pool; a member without a live lease leaves it
        ▼
    WorkerPool.add / remove (flows in flight on a leaving worker finish: see router.pool)

The registry is the Redis KV index the router already follows: a worker registers under its
gRPC address once it serves, unregisters on a clean shutdown (gone at once) and otherwise
leaves when its lease lapses (10 s after its last heartbeat). A worker of another model id or
role is ignored, with one warning per registration.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from kv_store.index import KVIndex
from router.pool import WorkerPool

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class MembershipPlan:
    """What one reconciliation changes; every entry is (role or address, detail)."""

    join: tuple[tuple[str, str], ...] = ()
    """(role, address) of registered workers that are not members yet."""
    leave: tuple[tuple[str, str], ...] = ()
    """(role, address) of members whose lease is gone (or who re-registered as another role)."""
    ignored: tuple[tuple[str, str], ...] = ()
    """(address, why) of registered workers this router does not route to."""


def plan_membership(registry: Mapping[str, Mapping[str, Any]], model_id: str,
                    members: Mapping[str, Collection[str]]) -> MembershipPlan:
    """The changes that make `members` (role → addresses) equal to the registry's workers
    (address → registration info) of `model_id` in the roles this router routes to."""
    wanted: dict[str, set[str]] = {role: set() for role in ROLES}
    ignored = []
    for address, info in sorted(registry.items()):
        role, mid = info.get("role"), info.get("model_id")
        if role not in wanted:
            ignored.append((address, f"role {role!r} is not one of {', '.join(ROLES)}"))
        elif mid != model_id:
            ignored.append((address, f"it serves model {mid!r}, this router {model_id!r}"))
        else:
            wanted[role].add(address)
    join, leave = [], []
    for role in ROLES:
        have = set(members.get(role, ()))
        join += [(role, a) for a in sorted(wanted[role] - have)]
        leave += [(role, a) for a in sorted(have - wanted[role])]
    return MembershipPlan(tuple(join), tuple(leave), tuple(ignored))


class Membership:
    """Keeps `pools` (role → pool) in step with the registry of a started, following index."""

    def __init__(self, index: KVIndex, pools: Mapping[str, WorkerPool], model_id: str,
                 max_model_len: int, period_s: float = 1.0) -> None:
        if set(pools) != set(ROLES):
            raise ValueError(f"pools must be keyed by {ROLES}, got {sorted(pools)}")
        self.index = index
        self.pools = pools
        self.model_id = model_id
        self.max_model_len = max_model_len
        self.period_s = period_s
        self._warned: set[tuple[str, str]] = set()  # (address, why) already logged
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        await self.reconcile()
        self._task = asyncio.create_task(self._run(), name="pool-membership")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def settle(self, timeout_s: float) -> bool:
        """Wait until the registry lists a decode worker of this model and every member
        answers its polls; False if that did not happen within `timeout_s` (the router then
        serves with what it has, possibly nothing: requests get UNAVAILABLE until a decode
        worker joins)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while True:
            await self.reconcile()
            members = [w for pool in self.pools.values() for w in pool.workers]
            if self.pools["decode"].workers and all(w.healthy for w in members):
                return True
            if loop.time() >= end:
                return False
            await asyncio.sleep(0.1)

    async def reconcile(self) -> MembershipPlan:
        """Apply one plan; a registry that cannot be read changes nothing."""
        try:
            registry = await self.index.workers()
        except Exception as exc:  # noqa: BLE001 — the index is a hint; keep what we have
            log.warning("worker registry unreadable (%s); pools unchanged", exc)
            return MembershipPlan()
        members = {role: [w.address for w in pool.workers] for role, pool in self.pools.items()}
        plan = plan_membership(registry, self.model_id, members)
        for role, address in plan.leave:
            self.pools[role].remove(address)
            log.info("%s worker %s left the registry; out of the pool", role, address)
        for role, address in plan.join:
            self.pools[role].add(address)
            log.info("%s worker %s joined from the registry", role, address)
            self._check_length(address, registry[address])
        self._warn_ignored(plan.ignored, registry)
        return plan

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            await self.reconcile()

    def _check_length(self, address: str, info: Mapping[str, Any]) -> None:
        n = info.get("max_model_len")
        if isinstance(n, int) and n < self.max_model_len:
            log.warning("worker %s accepts %d tokens, the router %d: longer requests sent to "
                        "it fail with INVALID_ARGUMENT", address, n, self.max_model_len)

    def _warn_ignored(self, ignored: tuple[tuple[str, str], ...],
                      registry: Mapping[str, Mapping[str, Any]]) -> None:
        for entry in ignored:
            if entry not in self._warned:
                log.warning("worker %s ignored: %s", *entry)
        # Forget registrations that are gone, so a worker that comes back is warned about again.
        self._warned = {e for e in self._warned | set(ignored) if e[0] in registry}
