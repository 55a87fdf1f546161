"""Latency metrics, percentiles, SLOs and goodput: pure functions of `RequestResult`s.

Definitions (per request, successful requests only):

- TTFT = first token arrival - send.
- E2E = last token arrival - send.
- TPOT = (E2E - TTFT) / (output tokens - 1); undefined for a one-token output.
- ITL = the gaps between successive token arrivals. A stream message carrying n tokens is one
  arrival: its gap to the previous arrival is spread evenly over its n tokens (n samples of
  gap / n), so the samples of a request add up to E2E - TTFT. Tokens that arrive together with
  the first token add no sample (their wait is TTFT's). With one token per message, a request's
  mean ITL equals its TPOT.

Percentiles interpolate linearly between closest ranks (numpy's default). Goodput is the number
of successful requests meeting every SLO, per second of the run; a failed request never counts,
and a request without a TPOT (one output token) cannot miss a TPOT SLO.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from pdserve.loadgen.records import Arrival, RequestResult

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class RequestMetrics:
    """One successful request's latencies, in seconds."""

    ttft: float
    tpot: float | None
    e2e: float
    itl: tuple[float, ...]


def request_metrics(r: RequestResult) -> RequestMetrics | None:
    """The latencies of a request; None when it failed or produced nothing."""
    if not r.ok:
        return None
    ttft = r.arrivals[0].time - r.send_time
    e2e = r.arrivals[-1].time - r.send_time
    tpot = (e2e - ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else None
    return RequestMetrics(ttft, tpot, e2e, tuple(itl_samples(r.arrivals)))


def itl_samples(arrivals: Sequence[Arrival]) -> list[float]:
    """Inter-token latencies of one stream (see the module docstring)."""
    out: list[float] = []
    for prev, cur in zip(arrivals, arrivals[1:], strict=False):
        out += [(cur.time - prev.time) / cur.tokens] * cur.tokens
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of non-empty values, linear between closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q: must be in [0, 100], got {q}")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass(frozen=True)
class Distribution:
    """Mean and percentiles of one latency, in milliseconds; None without samples."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None


def distribution_ms(values_s: Sequence[float]) -> Distribution:
    if not values_s:
        return Distribution(0, None, None, None, None)
    ms = [v * 1e3 for v in values_s]
    p50, p90, p99 = (percentile(ms, q) for q in PERCENTILES)
    return Distribution(len(ms), sum(ms) / len(ms), p50, p90, p99)


class SloMetric(StrEnum):
    TTFT = "ttft"
    TPOT = "tpot"
    E2E = "e2e"


@dataclass(frozen=True)
class Slo:
    """A request meets the SLO when its metric is at most limit_ms."""

    metric: SloMetric
    limit_ms: float

    def met(self, m: RequestMetrics) -> bool:
        value = getattr(m, self.metric.value)
        return value is None or value * 1e3 <= self.limit_ms


def parse_slos(items: Iterable[str]) -> tuple[Slo, ...]:
    """SLOs from "metric:ms" strings, e.g. ("ttft:500", "tpot:50"); ValueError names the item."""
    slos = []
    for item in items:
        name, sep, value = item.partition(":")
        try:
            metric = SloMetric(name.strip().lower())
            limit = float(value)
        except ValueError:
            metric, limit = None, math.nan
        if not sep or metric is None or not (math.isfinite(limit) and limit > 0):
            choices = ", ".join(m.value for m in SloMetric)
            raise ValueError(f"goodput: expected METRIC:MS with METRIC in {choices} and MS > 0, "
                             f"got {item!r}")
        slos.append(Slo(metric, limit))
    if len({s.metric for s in slos}) != len(slos):
        raise ValueError("goodput: each metric may appear once")
    return tuple(slos)


def meets_slos(m: RequestMetrics | None, slos: Sequence[Slo]) -> bool:
    return m is not None and all(s.met(m) for s in slos)


@dataclass(frozen=True)
class Summary:
    """Statistics of a set of requests over a run of `duration_s` seconds."""

    completed: int
    failed: int
    errors: dict[str, int]
    """Failed requests by status name."""
    error_examples: dict[str, str]
    """The first failure's message for each status name."""
    input_tokens: int
    """Prompt tokens of completed requests."""
    output_tokens: int
    """Generated tokens of completed requests."""
    cached_tokens: int
    """Prompt tokens the server reported as served from its cache."""
    duration_s: float
    request_throughput: float
    """Completed requests per second."""
    output_throughput: float
    """Generated tokens per second."""
    goodput: float | None
    """Requests per second meeting every SLO; None without SLOs."""
    slo_attainment: float | None
    """Share of all requests (failed ones included) meeting every SLO; None without SLOs."""
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2e_ms: Distribution


def summarize(results: Sequence[RequestResult], duration_s: float,
              slos: Sequence[Slo] = ()) -> Summary:
    """The statistics of results over a run of duration_s (> 0) seconds."""
    if not duration_s > 0:
        raise ValueError(f"duration_s: must be > 0, got {duration_s}")
    done = [(r, m) for r in results if (m := request_metrics(r)) is not None]
    failed = [r for r in results if not r.ok]
    errors = Counter(r.error or "NO_OUTPUT" for r in failed)
    examples: dict[str, str] = {}
    for r in failed:
        examples.setdefault(r.error or "NO_OUTPUT", r.error_detail or "")
    good = sum(meets_slos(m, slos) for _, m in done)
    return Summary(
        completed=len(done), failed=len(results) - len(done),
        errors=dict(sorted(errors.items())), error_examples=dict(sorted(examples.items())),
        input_tokens=sum(r.prompt_len for r, _ in done),
        output_tokens=sum(r.output_tokens for r, _ in done),
        cached_tokens=sum(r.cached_tokens or 0 for r, _ in done),
        duration_s=duration_s,
        request_throughput=len(done) / duration_s,
        output_throughput=sum(r.output_tokens for r, _ in done) / duration_s,
        goodput=good / duration_s if slos else None,
        slo_attainment=(good / len(results) if results else 0.0) if slos else None,
        ttft_ms=distribution_ms([m.ttft for _, m in done]),
        tpot_ms=distribution_ms([m.tpot for _, m in done if m.tpot is not None]),
        itl_ms=distribution_ms([x for _, m in done for x in m.itl]),
        e2e_ms=distribution_ms([m.e2e for _, m in done]))
