"""What the controller does next to make the running processes match the declared sizes: a
pure function of the targets, the members and their loads (no Ray, no clock of its own).

A member's life (the controller moves it; `TRANSITIONS` is the table):

    PLACING ──group ready──► STARTING ──READY line──► READY ──scale-down / down──► DRAINING
       │                        │                       │                            │
       └─ no node in time ──────┴─ exit / timeout ──►  FAILED                        ▼
                                                        │                         (gone)
                                READY ── exit / actor or node lost ──► LOST
    FAILED, LOST ──reaped──► (gone; a new member is started in its place)

Per role, `plan` counts the live members (PLACING, STARTING, READY), reaps the dead ones, and
starts or drains the difference: a role in backoff (its last start failed) starts nothing;
a surplus drains members that are not serving yet first (newest first), then the ready ones
that answer no stats, then the least loaded (`autoscale.least_loaded`). Routers drain newest
first.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pdserve.deploy.autoscale import WorkerLoad, load_rank


class Phase(enum.Enum):
    PLACING = "placing"
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"
    LOST = "lost"


TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.PLACING: frozenset({Phase.STARTING, Phase.FAILED, Phase.DRAINING}),
    Phase.STARTING: frozenset({Phase.READY, Phase.FAILED, Phase.DRAINING}),
    Phase.READY: frozenset({Phase.DRAINING, Phase.LOST}),
    Phase.DRAINING: frozenset(),
    Phase.FAILED: frozenset(),
    Phase.LOST: frozenset(),
}
LIVE = frozenset({Phase.PLACING, Phase.STARTING, Phase.READY})
DEAD = frozenset({Phase.FAILED, Phase.LOST})


def check_transition(old: Phase, new: Phase) -> None:
    if new not in TRANSITIONS[old]:
        raise ValueError(f"no transition {old.value} -> {new.value}")


@dataclass(frozen=True)
class Member:
    """What the plan needs to know of one process."""

    name: str
    role: str
    """router | prefill | decode."""
    phase: Phase
    serial: int
    """Creation order (larger = newer)."""


@dataclass(frozen=True)
class Plan:
    start: dict[str, int] = field(default_factory=dict)
    """New members to start, per role."""
    drain: tuple[str, ...] = ()
    """Members to stop gracefully (surplus)."""
    reap: tuple[str, ...] = ()
    """Dead members to release (their replacements are in `start`)."""

    @property
    def empty(self) -> bool:
        return not (any(self.start.values()) or self.drain or self.reap)


def plan(targets: Mapping[str, int], members: Sequence[Member],
         loads: Mapping[str, WorkerLoad] | None = None,
         blocked: frozenset[str] = frozenset()) -> Plan:
    """The next actions. `loads` holds the ready workers that answered their stats;
    `blocked` the roles whose starts are in backoff."""
    loads = loads or {}
    start: dict[str, int] = {}
    drain: list[str] = []
    for role, target in targets.items():
        live = [m for m in members if m.role == role and m.phase in LIVE]
        if len(live) < target and role not in blocked:
            start[role] = target - len(live)
        elif len(live) > target:
            drain += surplus(role, live, len(live) - target, loads)
    reap = tuple(m.name for m in members if m.phase in DEAD)
    return Plan(start, tuple(drain), reap)


def surplus(role: str, live: Sequence[Member], n: int,
            loads: Mapping[str, WorkerLoad]) -> list[str]:
    """The `n` members of `role` to drain first."""
    def key(m: Member) -> tuple:
        if m.phase is not Phase.READY:
            return (0, -m.serial)  # serves nobody yet: cheapest to drop
        if role == "router":
            return (1, -m.serial)
        if m.name not in loads:
            return (1, -m.serial)  # answers no stats: serves nobody well
        return (2, *load_rank(role, loads[m.name]), -m.serial)
    return [m.name for m in sorted(live, key=key)[:n]]


class Backoff:
    """Per role: after a failed start, wait `base_s`, doubling on each failure in a row up to
    `cap_s`; a start that reaches READY clears it. Time comes in as arguments."""

    def __init__(self, base_s: float, cap_s: float = 60.0) -> None:
        self.base_s, self.cap_s = base_s, cap_s
        self._fails: dict[str, int] = {}
        self._until: dict[str, float] = {}

    def failed(self, role: str, now: float) -> float:
        """Record a failure; the seconds until the next try."""
        n = self._fails.get(role, 0) + 1
        self._fails[role] = n
        wait = min(self.base_s * 2 ** (n - 1), self.cap_s)
        self._until[role] = now + wait
        return wait

    def succeeded(self, role: str) -> None:
        self._fails.pop(role, None)
        self._until.pop(role, None)

    def blocked(self, now: float) -> frozenset[str]:
        return frozenset(r for r, t in self._until.items() if now < t)

    def failures(self, role: str) -> int:
        return self._fails.get(role, 0)
