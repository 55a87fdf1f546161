"""When the controller takes its next autoscaling decision (`Cadence`), and how a decision
reads in a log (`describe`). Pure: time comes in as arguments, so a test drives it with a
fake clock.

    cadence = Cadence(period_s=15.0, now=clock())
    if cadence.due(clock()):
        started = clock(); ...decide and apply...; cadence.done(started, clock())

The first decision comes one period after the start, when the workers have had time to take
load. A round that overran the period (a scale-up waits for model loads) is followed by a
full period, so new workers take load before the pool is judged again; otherwise the cadence
is kept. A failed round counts as a round: the loop goes on.
"""

from __future__ import annotations

from pdserve.deploy.autoscale import Decision


class Cadence:
    def __init__(self, period_s: float, now: float) -> None:
        if not period_s > 0:
            raise ValueError(f"autoscale period_s must be > 0, got {period_s}")
        self.period_s = period_s
        self.next_at = now + period_s

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def done(self, started: float, now: float) -> None:
        """A round that began at `started` ended at `now`."""
        self.next_at = max(self.next_at, started) + self.period_s
        if self.next_at <= now:
            self.next_at = now + self.period_s


def describe(decision: Decision) -> str:
    """One line for a log: each pool's size (and target, when it changes) and the reason."""
    changes = decision.changes()
    parts = []
    for role, target in decision.targets.items():
        size = f"{changes[role][0]} -> {target}" if role in changes else f"{target}"
        parts.append(f"{role} {size} ({decision.reasons.get(role, '')})")
    return "; ".join(parts)
