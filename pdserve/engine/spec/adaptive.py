"""How many draft tokens to verify per request per step: pure policy objects, no tensors.

`AdaptiveK` picks k from the batch size and the measured acceptance, by maximising the
predicted output tokens per unit of step time:

- Acceptance: per request, an exponential moving average of accepted / tried drafts, started
  from the global average (itself started from a prior). A verification with k drafts of
  which a were accepted is a + 1 Bernoulli trials when a < k (the rejection was a trial) and k
  trials when all were accepted; a request with per-draft acceptance α then emits
  E(α, k) = 1 + α + ... + α^k tokens per step.
- Cost (`CostModel`): a forward over T tokens takes time ∝ knee + T, where the knee
  (`compute_bound_tokens`) is the token count at which a forward takes twice as long as a
  one-token forward: small on a CPU, hundreds on a GPU, where decode is bound by reading the
  weights. A draft model adds k draft forwards, `draft_cost_ratio` times as expensive each.
- Decision: for every k in 1..max_k, speculate on the m requests with the best acceptance,
  for the m that maximises (tokens emitted) / cost; keep the best (k, m), but only if it beats
  not speculating by `min_gain` — otherwise speculation is off for the step (large batches
  on a compute-bound device, or low acceptance).
- Probing: a request left without drafts for `probe_interval` steps gets k = 1 once (when a
  well-predicted request would pay at this batch size), so a low estimate can recover.

`FixedK` always proposes k (speculative_config.adaptive = false).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def default_compute_bound_tokens(device_type: str) -> int:
    """Cost-model knee per device kind (measured on a 2-core CPU; a typical GPU's decode is
    weight-read bound up to a few hundred tokens per forward)."""
    return 4 if device_type == "cpu" else 256


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one verification emits with k drafts each accepted with probability alpha."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass(frozen=True)
class CostModel:
    compute_bound_tokens: float
    """The knee: a forward over this many tokens takes twice as long as over one."""
    draft_cost_ratio: float = 0.0
    """One draft forward's cost relative to one target forward of the same tokens."""

    def step_cost(self, batch: int, drafted: int, k: int) -> float:
        """Relative time of a step of `batch` decode requests, `drafted` of them verifying k
        drafts each (draft forwards included)."""
        knee = self.compute_bound_tokens
        target = knee + batch + drafted * k
        draft = self.draft_cost_ratio * k * (knee + drafted) if drafted and k else 0.0
        return target + draft


@dataclass(frozen=True)
class AdaptiveConfig:
    max_k: int
    """Most drafts per request per step (num_speculative_tokens)."""
    cost: CostModel
    decay: float = 0.9
    """Weight of the past in the acceptance averages, per observation."""
    prior_acceptance: float = 0.5
    """Acceptance assumed before anything was measured."""
    prior_weight: float = 2.0
    """How many trials a new request's starting estimate (the global average) is worth."""
    min_gain: float = 1.05
    """Speculate only when the predicted throughput is at least this times that without."""
    probe_interval: int = 32
    """Steps without drafts after which a request is given one k = 1 probe."""
    probe_acceptance: float = 0.8
    """Probe only when a request with this acceptance would pay at the current batch size."""

    def __post_init__(self) -> None:
        if self.max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {self.max_k}")
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {self.decay}")
        if not 0.0 <= self.prior_acceptance <= 1.0:
            raise ValueError(f"prior_acceptance must be in [0, 1], got {self.prior_acceptance}")
        if self.cost.compute_bound_tokens <= 0:
            raise ValueError("cost.compute_bound_tokens must be positive")


@dataclass
class _Ema:
    """Moving sums of accepted drafts and trials; acceptance = accepted / trials."""

    accepted: float
    trials: float

    def add(self, accepted: int, trials: int, decay: float) -> None:
        self.accepted = decay * self.accepted + accepted
        self.trials = decay * self.trials + trials

    @property
    def rate(self) -> float:
        return self.accepted / self.trials if self.trials > 0 else 0.0


class AdaptiveK:
    def __init__(self, config: AdaptiveConfig) -> None:
        self.config = config
        w = config.prior_weight
        self._global = _Ema(config.prior_acceptance * w, w)
        self._requests: dict[str, _Ema] = {}
        self._idle_steps: dict[str, int] = {}
        self.last_k = 0
        """k chosen for the last step's speculating requests (0: speculation was off)."""

    @property
    def global_acceptance(self) -> float:
        return self._global.rate

    def acceptance(self, request_id: str) -> float:
        ema = self._requests.get(request_id)
        return ema.rate if ema is not None else self.global_acceptance

    def choose(self, request_ids: Sequence[str], batch_size: int) -> dict[str, int]:
        """k per request for the next step; `batch_size` counts every running request."""
        batch = max(batch_size, len(request_ids))
        alphas = sorted(((self.acceptance(r), r) for r in request_ids), reverse=True)
        k, m = self._plan([a for a, _ in alphas], batch)
        self.last_k = k
        chosen = {r: (k if i < m else 0) for i, (_, r) in enumerate(alphas)}
        probe_pays = self._pays(self.config.probe_acceptance, batch)
        for r in request_ids:
            if chosen[r] > 0:
                self._idle_steps[r] = 0
                continue
            idle = self._idle_steps.get(r, 0) + 1
            if idle >= self.config.probe_interval and probe_pays:
                chosen[r], idle = 1, 0
            self._idle_steps[r] = idle
        return chosen

    def observe(self, request_id: str, proposed: int, accepted: int) -> None:
        """A verification of `proposed` drafts accepted the first `accepted` of them."""
        if proposed <= 0:
            return
        if not 0 <= accepted <= proposed:
            raise ValueError(f"accepted must be in [0, {proposed}], got {accepted}")
        trials = accepted + (1 if accepted < proposed else 0)
        decay = self.config.decay
        ema = self._requests.get(request_id)
        if ema is None:
            w = self.config.prior_weight
            ema = self._requests[request_id] = _Ema(self.global_acceptance * w, w)
        ema.add(accepted, trials, decay)
        self._global.add(accepted, trials, decay)

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self._idle_steps.pop(request_id, None)

    # -- the decision ----------------------------------------------------------------------
    def _plan(self, alphas: Sequence[float], batch: int) -> tuple[int, int]:
        """(k, m): speculate k drafts on the m best requests (alphas sorted descending)."""
        cost = self.config.cost
        threshold = self.config.min_gain * batch / cost.step_cost(batch, 0, 0)
        best, best_k, best_m = threshold, 0, 0
        for k in range(1, self.config.max_k + 1):
            extra = 0.0
            for m, alpha in enumerate(alphas, start=1):
                extra += expected_tokens(alpha, k) - 1.0
                throughput = (batch + extra) / cost.step_cost(batch, m, k)
                if throughput > best:
                    best, best_k, best_m = throughput, k, m
        return best_k, best_m

    def _pays(self, alpha: float, batch: int) -> bool:
        cost = self.config.cost
        base = batch / cost.step_cost(batch, 0, 0)
        one = (batch + expected_tokens(alpha, 1) - 1.0) / cost.step_cost(batch, 1, 1)
        return one > base


class FixedK:
    """Always k drafts per request."""

    def __init__(self, k: int) -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.k = k
        self.last_k = k

    def choose(self, request_ids: Sequence[str], batch_size: int) -> dict[str, int]:
        return dict.fromkeys(request_ids, self.k)

    def observe(self, request_id: str, proposed: int, accepted: int) -> None:
        """Nothing to learn."""

    def forget(self, request_id: str) -> None:
        """Nothing to forget."""

    def acceptance(self, request_id: str) -> float:
        return 0.0

    @property
    def global_acceptance(self) -> float:
        return 0.0
