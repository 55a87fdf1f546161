"""The autoscaling loop: one `AutoscalePolicy` decision every `period_s`, applied by whatever
owns the pools — `RayCluster.autoscale_once` in the same process, or the controller actor of a
running `pdserve ray up --autoscale` (through `controller.RemoteCluster`).

    stop = threading.Event()
    autoscale_loop(cluster, AutoscalePolicy(config), stop.wait, period_s=15.0)

Time comes in as arguments (`wait`, `clock`), so a test drives the loop with a fake clock and
a fake cluster, without sleeping and without Ray. The policy's hysteresis state lives with the
cluster (it survives a failed round); this loop keeps none.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

from pdserve.deploy.autoscale import AutoscalePolicy, Decision

log = logging.getLogger(__name__)

DEFAULT_PERIOD_S = 15.0


class Autoscalable(Protocol):
    def autoscale_once(self, policy: AutoscalePolicy) -> Decision:
        """Observe the pools, decide with `policy`, apply; the decision."""
        ...


def autoscale_loop(cluster: Autoscalable, policy: AutoscalePolicy,
                   wait: Callable[[float], bool], period_s: float = DEFAULT_PERIOD_S,
                   clock: Callable[[], float] = time.monotonic,
                   logger: logging.Logger = log) -> int:
    """Decide and apply every `period_s` until `wait(seconds)` returns True (a stop was asked;
    `threading.Event.wait` fits). The first decision comes one period after the start, when the
    workers have had time to take load. Every decision is logged with its reasons; a failed
    round (a worker that could not be placed, an actor that did not answer) is logged and the
    loop goes on. Returns how many decisions were made."""
    if not period_s > 0:
        raise ValueError(f"autoscale period_s must be > 0, got {period_s}")
    decisions = 0
    next_at = clock() + period_s
    while not wait(max(0.0, next_at - clock())):
        try:
            decision = cluster.autoscale_once(policy)
        except Exception as exc:  # one failed round must not end autoscaling for good
            logger.warning("autoscale: round failed (%s: %s); next in %gs",
                           type(exc).__name__, exc, period_s)
        else:
            decisions += 1
            logger.info("autoscale: %s", describe(decision))
        next_at += period_s
        now = clock()
        if next_at <= now:
            # The round overran (a scale-up waits for model loads): give the new workers a full
            # period of load before the next look, rather than deciding again at once.
            next_at = now + period_s
    return decisions


def describe(decision: Decision) -> str:
    """One line for a log: each pool's size (and target, when it changes) and the reason."""
    changes = decision.changes()
    parts = []
    for role, target in decision.targets.items():
        size = f"{changes[role][0]} -> {target}" if role in changes else f"{target}"
        parts.append(f"{role} {size} ({decision.reasons.get(role, '')})")
    return "; ".join(parts)
