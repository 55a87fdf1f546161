"""Admission control: take a request now, or refuse it at once with a retry hint. Pure.

Inputs are the decode pool's load (`DecodeLoad` per healthy worker), the prefill pool's
(`PrefillLoad`), and the request's size and deadline (`RequestSize`); the output is an
`Admission`: the decode workers that may take it, or none and how long to wait before trying
again. No I/O: the router builds the inputs from `GetStats` and its own counts.

What a decode worker can serve, and its bounded queue:

    slots     = min(max_num_seqs, KV blocks / blocks one request needs)   requests run at once
    occupancy = requests on it, running or waiting (its stats, or this router's count if more)
    queue     : occupancy < min(slots × queue_waves, KV blocks / prompt blocks)
                (waiting requests already hold their prompt's blocks on the decode worker)

When the request would start (continuous batching, FCFS; the worker's measured step time
`StepTime`, every request assumed to run to its max_tokens, so the estimate is an upper bound):

    prefill   = best prefill worker: ceil((queued + prompt) / step budget) steps of budget tokens
                (queued: its stats, or what this router admitted and has not seen prefilled)
    waves     = occupancy // slots              whole batches ahead of it (0: a slot is free)
    start     = max(prefill, waves × mean_remaining × step(slots))   (both go on at once)
    finish    = start + max_tokens × step(occupancy % slots + 1)     (the batch it runs in)

A request with `n` choices (forked on one decode worker) is judged as its last choice, the
other n - 1 already there. Requests decided one after another see the batch each one makes:
once one would finish too late, every later one in that batch would too, so what is admitted
fits together.

A worker takes the request when its queue has room and the request finishes before
`deadline × (1 - margin)`: one that would wait in a queue, or make the batch too slow, and
cannot finish in time is refused at once, instead of taking capacity and ending in
DEADLINE_EXCEEDED. One that could not finish in time even alone on an idle worker is taken if a
slot is free (that is its own size, not load: it ends DEADLINE_EXCEEDED as it always would).
Until a worker has a measured step time it takes only what it can start at once.

Step times are the workers' own models (`WorkerStats.step_model`) scaled by `Slowdown`: how
much slower the router's streams actually get their tokens than those models predict.

The retry hint is the shortest time after which some worker would take it: for a full queue,
until one request there finishes; for a late finish, how late it would be.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

MIN_RETRY_S = 0.05
MAX_RETRY_S = 60.0


@dataclass(frozen=True)
class StepTime:
    """A worker's measured engine step: base_s + per_token_s × tokens computed in the step."""

    base_s: float
    per_token_s: float

    def seconds(self, tokens: float) -> float:
        return self.base_s + self.per_token_s * max(tokens, 1.0)


@dataclass
class Slowdown:
    """How much slower tokens reach this router than the workers' step models predict: what
    the models cannot see (the router's own loop, the network, a CPU shared with other
    processes). An exponentially weighted mean of observed / predicted time per token; the
    step times admission uses are scaled by it."""

    alpha: float = 0.02
    factor: float = 1.0

    def observe(self, observed_s: float, predicted_s: float) -> None:
        if observed_s <= 0.0 or predicted_s <= 0.0:
            return
        ratio = min(max(observed_s / predicted_s, 0.25), 20.0)  # one stall must not rule
        self.factor += self.alpha * (ratio - self.factor)

    def scale(self, step: StepTime | None) -> StepTime | None:
        if step is None:
            return None
        return StepTime(step.base_s * self.factor, step.per_token_s * self.factor)


@dataclass(frozen=True)
class DecodeLoad:
    index: int
    max_seqs: int
    """Its engine's max_num_seqs (0: unknown, KV alone bounds it)."""
    kv_blocks_total: int
    block_size: int
    occupancy: int
    """Requests there, running or waiting."""
    mean_remaining: float
    """Output tokens each of them may still produce, on average (from their max_tokens)."""
    step: StepTime | None
    """None until the worker has measured itself."""


@dataclass(frozen=True)
class PrefillLoad:
    queued_tokens: int
    """Prompt tokens queued there (its stats plus what this router sent since)."""
    step_budget: int
    """Tokens one step may compute (max_num_batched_tokens)."""
    step: StepTime | None


@dataclass(frozen=True)
class RequestSize:
    prompt_tokens: int
    max_tokens: int
    """Output tokens it may produce (max_tokens, capped by the context left)."""
    deadline_s: float
    """Seconds left before its deadline."""
    remote_prefill: bool = True
    """Its prompt goes to a prefill worker (else the decode worker computes it)."""
    count: int = 1
    """Sequences it runs at once on one decode worker (its `n` choices, forked there)."""


@dataclass(frozen=True)
class AdmissionConfig:
    queue_waves: int = 4
    """Longest queue on a decode worker, in batches of `slots` requests."""
    margin: float = 0.1
    """Part of the deadline kept back for what the estimate misses."""
    enabled: bool = True
    """False: admit everything (a baseline for benchmarks)."""

    def __post_init__(self) -> None:
        if self.queue_waves < 1:
            raise ValueError(f"queue_waves must be >= 1, got {self.queue_waves}")
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"margin must be in [0, 1), got {self.margin}")


@dataclass(frozen=True)
class Admission:
    workers: tuple[int, ...]
    """Indices of the decode workers that may take it; empty: refused."""
    retry_after_s: float = 0.0
    reason: str = ""

    @property
    def admitted(self) -> bool:
        return bool(self.workers)


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-max(tokens, 1) // max(block_size, 1))


def slots(w: DecodeLoad, size: RequestSize) -> int:
    """Requests of this size the worker can run at once."""
    by_kv = w.kv_blocks_total // blocks_for(size.prompt_tokens + size.max_tokens, w.block_size)
    return max(min(w.max_seqs, by_kv) if w.max_seqs > 0 else by_kv, 0)


def queue_limit(w: DecodeLoad, size: RequestSize, config: AdmissionConfig) -> int:
    """Most requests of this size the worker may hold, running or waiting."""
    by_prompt_kv = w.kv_blocks_total // blocks_for(size.prompt_tokens, w.block_size)
    return min(slots(w, size) * config.queue_waves, by_prompt_kv)


def capacity(loads: Sequence[DecodeLoad], size: RequestSize, config: AdmissionConfig) -> int:
    """The router's in-flight cap for requests like this one: the pool's queues, summed."""
    return sum(queue_limit(w, size, config) for w in loads)


def prefill_wait_s(pool: Sequence[PrefillLoad], size: RequestSize) -> float:
    """Time before the request's first token on the best prefill worker (0 if unknown)."""
    if not size.remote_prefill:
        return 0.0
    waits = [_prefill_s(p, size.prompt_tokens) for p in pool if p.step is not None]
    return min(waits, default=0.0)


def _prefill_s(p: PrefillLoad, prompt_tokens: int) -> float:
    assert p.step is not None
    tokens = p.queued_tokens + prompt_tokens
    budget = max(p.step_budget, 1)
    steps = math.ceil(tokens / budget)
    return steps * p.step.base_s + tokens * p.step.per_token_s


def estimate(w: DecodeLoad, size: RequestSize, prefill_s: float) -> tuple[float, float]:
    """(start, finish) seconds from now on worker `w` (requires `w.step`)."""
    assert w.step is not None
    n = max(slots(w, size), 1)
    waves = w.occupancy // n
    start = max(prefill_s, waves * w.mean_remaining * w.step.seconds(n))
    finish = start + size.max_tokens * w.step.seconds(w.occupancy % n + 1)
    return start, finish


def decide(loads: Sequence[DecodeLoad], prefill: Sequence[PrefillLoad], size: RequestSize,
           config: AdmissionConfig = AdmissionConfig()) -> Admission:
    if not config.enabled or not loads:
        # No decode worker: the flow answers UNAVAILABLE (retryable), not this policy.
        return Admission(tuple(w.index for w in loads))
    budget = size.deadline_s * (1.0 - config.margin)
    pre = prefill_wait_s(prefill, size)
    pre_alone = prefill_wait_s([dataclasses.replace(p, queued_tokens=0) for p in prefill], size)
    taken: list[int] = []
    retry = math.inf
    reasons: list[str] = []
    for w in loads:
        ok, wait, why = _judge(w, size, config, budget, pre, pre_alone)
        if ok:
            taken.append(w.index)
        else:
            retry = min(retry, wait)
            reasons.append(why)
    if taken:
        return Admission(tuple(taken))
    retry = min(max(retry, MIN_RETRY_S), MAX_RETRY_S)
    return Admission((), retry, reasons[0] if len(set(reasons)) == 1 else "; ".join(reasons))


def _judge(w: DecodeLoad, size: RequestSize, config: AdmissionConfig, budget: float,
           pre: float, pre_alone: float) -> tuple[bool, float, str]:
    """(takes it, retry hint if not, why not) for one decode worker."""
    if size.count > 1:  # judged as its last choice, the others already there
        w = dataclasses.replace(w, occupancy=w.occupancy + size.count - 1)
    n = slots(w, size)
    if n < 1:
        return False, MAX_RETRY_S, (f"decode worker {w.index}: the request needs more KV "
                                    "blocks than it has")
    free_slot = w.occupancy < n
    # Continuous batching frees a slot every (remaining tokens × step) / slots on average.
    step_n = w.step.seconds(n) if w.step is not None else 0.0
    next_free = max(w.mean_remaining, 1.0) * step_n / n if w.step is not None else 1.0
    if w.occupancy >= queue_limit(w, size, config):
        return False, next_free, f"decode queue full ({w.occupancy} requests)"
    if w.step is None:
        return free_slot, next_free, "decode worker busy (speed not measured yet)"
    _, finish = estimate(w, size, pre)
    if finish <= budget:
        return True, 0.0, ""
    if free_slot and pre_alone + size.max_tokens * w.step.seconds(1) > budget:
        return True, 0.0, ""  # too big for its deadline even alone: its size, not the load
    return False, max(finish - budget, next_free), (
        f"cannot finish before its deadline (estimated {finish:.1f}s, "
        f"deadline in {size.deadline_s:.1f}s)")
