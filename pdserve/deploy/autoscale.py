"""Autoscaling policy for the two pools, each on the signal of its own bottleneck. Pure: it
takes load figures and its previous state, and returns target sizes and its next state; the
caller (`RayCluster.autoscale_once`, or a test) applies them.

    prefill pool: mean queued prefill tokens per worker (compute waiting to be done: TTFT)
    decode pool:  mean KV-cache usage per worker, used / total blocks (memory: admission)

Hysteresis, per pool, so a noisy signal never makes a pool flap:
  - scale up only after `up_after` consecutive observations above `high`, to the size that
    brings the mean back to `high` (proportional, at least +1, at most `max_step_up`);
  - scale down only after `down_after` consecutive observations below `low`, one worker at a
    time, and only if the remaining workers would stay at or under `high`;
  - a band `low < high` in between where nothing happens; bounds apply at once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

ROLES = ("prefill", "decode")
"""The two worker pools, in the order they are reported."""


@dataclass(frozen=True)
class WorkerLoad:
    """One worker's load, as its GetStats reports it."""

    queued_prefill_tokens: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0

    @classmethod
    def from_stats(cls, stats: Mapping[str, int]) -> WorkerLoad:
        return cls(**{k: int(stats.get(k, 0)) for k in cls.__dataclass_fields__})

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


def pool_signal(role: str, loads: Sequence[WorkerLoad]) -> float:
    """The figure a pool is scaled on (see the module docstring); 0 for no loads."""
    if not loads:
        return 0.0
    if role == "prefill":
        return sum(w.queued_prefill_tokens for w in loads) / len(loads)
    return sum(w.kv_usage for w in loads) / len(loads)


def load_rank(role: str, load: WorkerLoad) -> tuple[float, ...]:
    """How busy a worker is, for picking which one to remove (smallest first): the pool's
    signal, then the requests it holds (each one is cut or delayed by its removal)."""
    main = load.queued_prefill_tokens if role == "prefill" else load.kv_usage
    return (main, load.num_running + load.num_waiting)


def least_loaded(role: str, loads: Mapping[str, WorkerLoad]) -> str:
    """The name of the worker to remove first."""
    if not loads:
        raise ValueError("least_loaded: no workers")
    return min(sorted(loads), key=lambda name: load_rank(role, loads[name]))


@dataclass(frozen=True)
class ScaleRule:
    """Bounds and thresholds of one pool."""

    min_replicas: int = 1
    """Fewest workers the policy leaves (>= 1 under autoscaling)."""
    max_replicas: int = 8
    """Most workers the policy asks for."""
    high: float = 1.0
    """Scale up above this (prefill: queued tokens per worker; decode: KV usage, 0..1)."""
    low: float = 0.0
    """Scale down below this; must be < high (the band between is the hysteresis)."""
    up_after: int = 2
    """Consecutive observations above `high` before scaling up."""
    down_after: int = 6
    """Consecutive observations below `low` before scaling down (slower than up: adding a
    worker costs a model load, removing one too early costs an SLO)."""
    max_step_up: int = 4
    """Most workers added in one decision."""

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"ScaleRule: need 0 <= min_replicas <= max_replicas, got "
                             f"{self.min_replicas}, {self.max_replicas}")
        if not self.low < self.high:
            raise ValueError(f"ScaleRule: low ({self.low}) must be < high ({self.high})")
        for name in ("up_after", "down_after", "max_step_up"):
            if getattr(self, name) < 1:
                raise ValueError(f"ScaleRule.{name} must be >= 1")


@dataclass(frozen=True)
class AutoscaleConfig:
    """Autoscaling of both pools, run by the controller every `period_s`."""

    prefill: ScaleRule = field(default_factory=lambda: ScaleRule(high=2048.0, low=256.0))
    """Prefill pool: on mean queued prefill tokens per worker."""
    decode: ScaleRule = field(default_factory=lambda: ScaleRule(high=0.8, low=0.3))
    """Decode pool: on mean KV-cache usage (0..1) per worker."""
    period_s: float = 15.0
    """Seconds between decisions (a decision that scales waits for the new workers to load:
    the next one comes a full period after it)."""

    def __post_init__(self) -> None:
        if not self.period_s > 0:
            raise ValueError(f"AutoscaleConfig.period_s must be > 0, got {self.period_s}")
        for role in ROLES:
            if self.rule(role).min_replicas < 1:  # an empty pool reports no load: never regrows
                raise ValueError(f"autoscale.{role}.min_replicas must be >= 1, got "
                                 f"{self.rule(role).min_replicas}")

    def rule(self, role: str) -> ScaleRule:
        return self.prefill if role == "prefill" else self.decode


@dataclass(frozen=True)
class PoolTrend:
    """Consecutive observations above `high` / below `low` so far."""

    above: int = 0
    below: int = 0


@dataclass(frozen=True)
class AutoscaleState:
    trends: dict[str, PoolTrend] = field(default_factory=dict)

    def trend(self, role: str) -> PoolTrend:
        return self.trends.get(role, PoolTrend())


@dataclass(frozen=True)
class Decision:
    targets: dict[str, int]
    """Target size of each pool (equal to the current size when nothing changes)."""
    state: AutoscaleState
    """Pass back into the next `decide`."""
    reasons: dict[str, str]
    """Why, per pool, for logs."""
    sizes: dict[str, int]
    """The size of each pool the decision was made from."""

    def changes(self) -> dict[str, tuple[int, int]]:
        """(current, target) of each pool whose size changes."""
        return {role: (self.sizes.get(role, 0), target) for role, target in self.targets.items()
                if target != self.sizes.get(role, 0)}


class AutoscalePolicy:
    def __init__(self, config: AutoscaleConfig | None = None) -> None:
        self.config = config or AutoscaleConfig()

    def decide(self, sizes: Mapping[str, int], loads: Mapping[str, Sequence[WorkerLoad]],
               state: AutoscaleState | None = None) -> Decision:
        """Targets for both pools. `sizes` counts every worker of a pool (also those whose
        stats did not answer: a missing figure must not shrink a pool); `loads` holds the
        figures that did answer."""
        state = state or AutoscaleState()
        targets, trends, reasons = {}, {}, {}
        for role in ROLES:
            targets[role], trends[role], reasons[role] = self._decide_pool(
                role, int(sizes.get(role, 0)), loads.get(role, ()), state.trend(role))
        return Decision(targets, AutoscaleState(trends), reasons,
                        {role: int(sizes.get(role, 0)) for role in ROLES})

    def _decide_pool(self, role: str, n: int, loads: Sequence[WorkerLoad],
                     trend: PoolTrend) -> tuple[int, PoolTrend, str]:
        rule = self.config.rule(role)
        if n < rule.min_replicas or n > rule.max_replicas:
            target = min(max(n, rule.min_replicas), rule.max_replicas)
            return target, PoolTrend(), f"bounds [{rule.min_replicas}, {rule.max_replicas}]"
        if not loads:
            return n, PoolTrend(), "no load figures"
        signal = pool_signal(role, loads)
        trend = PoolTrend(above=trend.above + 1 if signal > rule.high else 0,
                          below=trend.below + 1 if signal < rule.low else 0)
        if trend.above:
            why = f"{signal:.3g} > high {rule.high:g}"
            if n >= rule.max_replicas:
                return n, trend, f"{why}, at max {rule.max_replicas}"
            if trend.above < rule.up_after:
                return n, trend, f"{why}, {trend.above} of {rule.up_after} in a row"
            want = math.ceil(n * signal / rule.high)
            target = min(max(want, n + 1), n + rule.max_step_up, rule.max_replicas)
            return target, PoolTrend(), why
        if trend.below:
            why = f"{signal:.3g} < low {rule.low:g}"
            if n <= rule.min_replicas:
                return n, trend, f"{why}, at min {rule.min_replicas}"
            if trend.below < rule.down_after:
                return n, trend, f"{why}, {trend.below} of {rule.down_after} in a row"
            if n == 1 or signal * n / (n - 1) <= rule.high:
                return n - 1, PoolTrend(), why
            # The others would be pushed over high: stay, and count the streak again.
            return n, replace(trend, below=0), (f"{why}, but {n - 1} workers would be over "
                                                f"high {rule.high:g}")
        return n, trend, f"{signal:.3g} within [{rule.low:g}, {rule.high:g}]"
