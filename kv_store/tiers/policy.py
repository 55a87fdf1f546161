"""Load-or-recompute: pure functions plus the measured speeds they are fed with.

Loading a block from a lower tier beats recomputing it only when `bytes / tier_bw` is below
`tokens / prefill_tps`. Both speeds are exponential moving averages of real copies and real
forward passes. An unmeasured speed counts as "load" (optimistic) so the first copy measures the
tier; after that a slow tier is skipped, so it can never make TTFT worse than no cache by more
than that one probe.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

from kv_store.index.events import Tier


def should_load(nbytes: int, tier_bw: float | None, ntokens: int,
                prefill_tps: float | None) -> bool:
    """True when copying `nbytes` at `tier_bw` B/s is faster than recomputing `ntokens`."""
    if nbytes <= 0 or ntokens <= 0:
        return ntokens > 0
    if not tier_bw or not prefill_tps:
        return True  # unmeasured: load once to measure
    return nbytes / tier_bw < ntokens / prefill_tps


def plan_load(tiers: Sequence[Tier], block_bytes: int, block_tokens: int,
              bandwidth: Mapping[Tier, float | None], prefill_tps: float | None) -> int:
    """How many leading blocks of a run (block i found in `tiers[i]`) to load; the rest are
    recomputed. Picks the prefix that saves the most time: only a prefix is usable, since a
    block after a recomputed one is recomputed anyway (its attention needs the earlier KV)."""
    best_k, best_gain, gain = 0, 0.0, 0.0
    for i, tier in enumerate(tiers):
        bw = bandwidth.get(tier)
        if bw and prefill_tps:
            gain += block_tokens / prefill_tps - block_bytes / bw
        else:
            gain += _PROBE_GAIN  # unmeasured: loading it is how it gets measured
        if gain > best_gain:
            best_k, best_gain = i + 1, gain
    return best_k


_PROBE_GAIN = 1e-9


def demote_ahead_window(configured: int, host_slots: int) -> int:
    """How many of the next device blocks in eviction order are kept copied in host memory
    ahead of time: at most a quarter of the host tier, so that copies made ahead (some of
    which a prefix hit takes back before eviction) never churn the host tier's LRU."""
    return max(0, min(configured, host_slots // 4))


class EMA:
    """Exponential moving average of a rate; None until the first sample."""

    def __init__(self, alpha: float = 0.3) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.value: float | None = None

    def add(self, amount: float, seconds: float) -> None:
        if amount <= 0 or seconds <= 0:
            return
        rate = amount / seconds
        self.value = rate if self.value is None else (
            self.alpha * rate + (1.0 - self.alpha) * self.value)


class BandwidthModel:
    """Measured read bandwidth per lower tier (B/s) and the engine's prefill speed (tokens/s).
    Thread-safe: SSD reads report from I/O threads."""

    def __init__(self, alpha: float = 0.3) -> None:
        self._lock = threading.Lock()
        self._read = {Tier.HOST: EMA(alpha), Tier.SSD: EMA(alpha)}
        self._prefill = EMA(alpha)

    def record_read(self, tier: Tier, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._read[tier].add(nbytes, seconds)

    def record_prefill(self, ntokens: int, seconds: float) -> None:
        with self._lock:
            self._prefill.add(ntokens, seconds)

    def bandwidth(self) -> dict[Tier, float | None]:
        with self._lock:
            return {t: e.value for t, e in self._read.items()}

    @property
    def prefill_tps(self) -> float | None:
        with self._lock:
            return self._prefill.value
