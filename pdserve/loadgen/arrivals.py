"""When each request of the open-loop stream is sent: Poisson or gamma arrival processes.

Inter-arrival gaps are gamma-distributed with shape k (the burstiness) and mean 1 / rate:
k = 1 is the Poisson process (exponential gaps), k < 1 is burstier, k > 1 more regular. A rate
of infinity sends every request at once. Gaps are a pure function of (spec, seed).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from enum import StrEnum


class ArrivalProcess(StrEnum):
    POISSON = "poisson"
    GAMMA = "gamma"


@dataclass(frozen=True)
class ArrivalSpec:
    """How requests arrive."""

    rate: float = math.inf
    """Mean requests per second; inf sends everything at time 0."""
    process: ArrivalProcess = ArrivalProcess.POISSON
    burstiness: float = 1.0
    """Gamma shape k (only for GAMMA; POISSON is k = 1)."""

    def __post_init__(self) -> None:
        if not (self.rate > 0):  # also refuses NaN
            raise ValueError(f"request_rate: must be > 0 (or inf), got {self.rate}")
        if not (math.isfinite(self.burstiness) and self.burstiness > 0):
            raise ValueError(f"burstiness: must be a positive number, got {self.burstiness}")
        if self.process is ArrivalProcess.POISSON and self.burstiness != 1.0:
            raise ValueError("burstiness: only applies to the gamma arrival process "
                             "(Poisson is burstiness 1)")

    @property
    def shape(self) -> float:
        return 1.0 if self.process is ArrivalProcess.POISSON else self.burstiness


def send_offsets(n: int, spec: ArrivalSpec, seed: int) -> list[float]:
    """Send times in seconds from the start of the run for n requests; the first is at 0."""
    if n < 0:
        raise ValueError(f"n: must be >= 0, got {n}")
    if math.isinf(spec.rate):
        return [0.0] * n
    rng = random.Random(seed)
    scale = 1.0 / (spec.rate * spec.shape)  # gamma mean = shape * scale = 1 / rate
    offsets, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.gammavariate(spec.shape, scale)
        offsets.append(t)
    return offsets
