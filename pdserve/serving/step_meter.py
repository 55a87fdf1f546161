"""A worker's speed model: how long one engine step takes, from the tokens it computes.

    seconds(step) ≈ base_s + per_token_s × tokens     (decode tokens + prefill chunk tokens)

The router's admission control (`router/admission.py`) reads it from `GetStats` to predict
when a request can start and finish. A line fits both roles well enough: on the small batches
a worker runs, a step is a fixed cost (weights read, kernel launches, Python) plus a cost per
token computed, and a decode step computes one token per running request.

The fit is a least-squares line over two sets of points:
- a start-up calibration (`calibrate`): a few dummy decode steps at batch 1 and at a large
  batch, so the model knows what batching buys before any traffic arrives. Kept as a prior
  of fixed weight, so a long run of steps at one batch size never leaves the slope undefined.
- every real step, exponentially weighted (recent steps count most: `decay` per step).

`observe` runs on the engine thread; `model` is read from any thread (it returns the last
fitted frozen value, replaced by one reference assignment).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams

CALIBRATION_STEPS = 3
"""Measured decode steps per calibration batch (after one unmeasured warm-up step)."""
CALIBRATION_MAX_BATCH = 64
"""Largest calibration batch: enough to see the slope, cheap on a CPU at start-up."""


@dataclass(frozen=True)
class StepModel:
    """Seconds per engine step as a linear function of the tokens it computes."""

    base_s: float = 0.0
    """Fixed cost of a step."""
    per_token_s: float = 0.0
    """Cost of each token computed in the step."""
    samples: int = 0
    """Steps behind the fit (calibration included); 0: no model yet."""

    def seconds(self, tokens: float) -> float:
        return self.base_s + self.per_token_s * max(tokens, 1.0)


class _Sums:
    """Weighted sums for a least-squares line."""

    def __init__(self) -> None:
        self.w = self.x = self.y = self.xx = self.xy = 0.0

    def add(self, x: float, y: float, w: float = 1.0) -> None:
        self.w += w
        self.x += w * x
        self.y += w * y
        self.xx += w * x * x
        self.xy += w * x * y

    def scale(self, f: float) -> None:
        self.w, self.x, self.y, self.xx, self.xy = (
            f * self.w, f * self.x, f * self.y, f * self.xx, f * self.xy)


class StepMeter:
    def __init__(self, decay: float = 0.99, prior_weight: float = 20.0) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.decay = decay
        self.prior_weight = prior_weight
        self._prior = _Sums()  # calibration points, each worth prior_weight / their count
        self._prior_points: list[tuple[float, float]] = []
        self._live = _Sums()
        self._samples = 0
        self._model = StepModel()

    def model(self) -> StepModel:
        return self._model

    def calibrated(self, points: list[tuple[int, float]]) -> None:
        """Set the prior from calibration (tokens, seconds) points."""
        self._prior = _Sums()
        for x, y in points:
            self._prior.add(float(x), y, self.prior_weight / max(len(points), 1))
        self._prior_points = [(float(x), y) for x, y in points]
        self._samples += len(points)
        self._refit()

    def observe(self, tokens: int, seconds: float) -> None:
        """One real engine step that computed `tokens` tokens in `seconds`."""
        if tokens <= 0 or seconds <= 0.0:
            return
        self._live.scale(self.decay)
        self._live.add(float(tokens), seconds)
        self._samples += 1
        self._refit()

    def _refit(self) -> None:
        s = _Sums()
        for part in (self._prior, self._live):
            s.w += part.w
            s.x += part.x
            s.y += part.y
            s.xx += part.xx
            s.xy += part.xy
        if s.w <= 0.0:
            return
        mean_x, mean_y = s.x / s.w, s.y / s.w
        var = s.xx / s.w - mean_x * mean_x
        if var <= 1e-9 * max(mean_x * mean_x, 1.0):
            # One batch size only: no slope to see. Proportional through the origin is the
            # cautious reading (no gain from batching assumed beyond what was seen).
            slope, base = mean_y / max(mean_x, 1.0), 0.0
        else:
            slope = max((s.xy / s.w - mean_x * mean_y) / var, 0.0)
            base = max(mean_y - slope * mean_x, 0.0)
        self._model = StepModel(base, slope, self._samples)


def calibrate(engine: LLMEngine, meter: StepMeter, max_batch: int = CALIBRATION_MAX_BATCH,
              steps: int = CALIBRATION_STEPS) -> None:
    """Time a few dummy decode steps at batch 1 and at a large batch (before serving; the
    caller owns the engine). Prompts of one token and a few output tokens never fill a KV
    block, so nothing reaches the prefix cache or the KV index."""
    bs = engine.config.block_size
    if bs < steps + 3 or engine.has_unfinished():
        return  # a block would fill (published to the prefix cache); or not idle
    big = max(2, min(max_batch, engine.config.max_num_seqs, engine.config.max_num_batched_tokens,
                     engine.pool.num_blocks))
    _run_batch(engine, 1, 1)  # warm-up: first forwards pay one-off costs
    points = []
    for batch in (1, big):
        points += _run_batch(engine, batch, steps)
    meter.calibrated(points)


def _run_batch(engine: LLMEngine, batch: int, steps: int) -> list[tuple[int, float]]:
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"calibrate-{batch}-{i}", [0], params, seed=0)
    points = []
    try:
        while engine.has_unfinished():
            t0 = time.perf_counter()
            engine.step()
            points.append((batch, time.perf_counter() - t0))
    finally:
        for i in range(batch):
            engine.abort(f"calibrate-{batch}-{i}")
    return points[1:1 + steps]  # the first step is the batch's (one-token) prefill
