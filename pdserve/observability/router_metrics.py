"""The router's request metrics, and the per-request trace that feeds them and the log.

    start ─► first token (TTFT) ─► token chunks (ITL: gap between chunks) ─► finish(status)
                                                       E2E and TPOT, when it finished OK

TTFT is observed for every request that produced a token; E2E and TPOT only for requests
that finished OK (errors are counted by status in `pdserve_requests_total`, and a fast failure
would otherwise pull the latency percentiles down). TPOT = (last token - first token) /
(generated tokens - 1). ITL is the gap a streaming client sees between two chunks; a chunk may
carry several tokens (speculative decoding).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.observability.logs import request_log
from pdserve.observability.vllm_metrics import FinishedRequest, VllmRequestMetrics

# One bucket set must serve a 2-core CPU (seconds per token) and a GPU (milliseconds).
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
                0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05,
                 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0,
               60.0, 120.0, 300.0, 600.0)
# The flow's own counts (`router.flow.Flow.counters` key -> metric name, help), read at scrape
# time so the flow's hot path stays a dict increment.
FLOW_COUNTERS = {
    "prefetch_hints": ("pdserve_router_prefetch_hints",
                       "Prefetch hints sent to workers whose prefix match runs into host/SSD."),
    "prefetch_hint_failures": ("pdserve_router_prefetch_hint_failures",
                               "Prefetch hints that failed or timed out (only hints)."),
    "kv_pulls_routed": ("pdserve_router_kv_pulls_routed",
                        "Requests sent to a decode worker with a KV source to pull from."),
    "migrations": ("pdserve_router_migrations",
                   "Requests moved to another worker after a worker failed them."),
    "drain_refusals": ("pdserve_router_drain_refusals",
                       "Attempts a draining worker refused, placed again elsewhere (before "
                       "anything ran: not migrations)."),
}
# Counted per cause under "migrations.<cause>" (router.migration.LostCause values).
MIGRATION_CAUSES = ("decode_lost", "decode_unresponsive", "decode_ended", "prefill_lost")


class RouterMetrics:
    """The router's metric objects, registered on `registry` (its own unless given)."""

    def __init__(self, registry: CollectorRegistry | None = None, model_name: str = "") -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        # vLLM's names for the same observations (labelled model_name), beside ours.
        self.vllm = VllmRequestMetrics(r, model_name)
        self.waiting = 0
        """Requests in flight that have no token yet (queued, or in prefill)."""
        self.running = 0
        """Requests in flight past their first token."""
        self.ttft = Histogram("pdserve_request_ttft_seconds",
                              "Time from request arrival to its first token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("pdserve_request_tpot_seconds",
                              "Mean time per output token after the first, per request.",
                              buckets=TOKEN_BUCKETS, registry=r)
        self.itl = Histogram("pdserve_request_itl_seconds",
                             "Gap between two consecutive token chunks of a request.",
                             buckets=TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_request_e2e_seconds",
                             "Time from request arrival to its last token (OK requests).",
                             buckets=E2E_BUCKETS, registry=r)
        self.requests = Counter("pdserve_requests", "Requests by final gRPC status.",
                                ["status"], registry=r)
        self.requests.labels("OK")  # present (at 0) before the first request: rate() works
        self.inflight = Gauge("pdserve_requests_inflight", "Requests being served now.",
                              registry=r)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens of requests.",
                                     registry=r)
        self.generation_tokens = Counter("pdserve_generation_tokens",
                                         "Tokens generated and streamed to clients.", registry=r)
        self.cached_tokens = Counter("pdserve_cached_prompt_tokens",
                                     "Prompt tokens served from a worker's prefix cache.",
                                     registry=r)
        self.admission_slowdown = Gauge(
            "pdserve_router_admission_slowdown",
            "Time per token the router's streams see over what the decode workers' step "
            "models predict (admission scales step times by it).", registry=r)
        self.admission_slowdown.set(1.0)

    def export_flow_counters(self, counters: Callable[[], Mapping[str, float]]) -> None:
        """Export the flow's counters (`FLOW_COUNTERS`), read from `counters()` on each
        scrape; call once per registry."""
        self.registry.register(FlowCounterCollector(counters))

    def export_pools(self, workers: Callable[[], Iterable[tuple[str, str, int]]],
                     index_blocks: Callable[[str], int]) -> None:
        """Export per-worker polls and index blocks (`PoolCollector`); call once."""
        self.registry.register(PoolCollector(workers, index_blocks))

    def export_front_refusals(self, refusals: Callable[[], int]) -> None:
        """Export the gRPC front's count of messages refused from their length prefix."""
        self.registry.register(FrontCollector(refusals))

    def trace(self, request_id: str, prompt_tokens: int, log: logging.Logger,
              clock: Callable[[], float] = time.perf_counter, n: int = 1,
              max_tokens: int = 0) -> RequestTrace:
        """Start observing one request (`n`, `max_tokens`: its parameters, for vLLM's
        request_params histograms)."""
        return RequestTrace(self, request_id, prompt_tokens, log, clock, n, max_tokens)


class PoolCollector(Collector):
    """Per worker, read on each scrape: stats polls answered, and the KV index's blocks for it
    (what KV-aware routing knows). A client that needs the router to have seen a worker's
    blocks waits for that worker's next poll."""

    def __init__(self, workers: Callable[[], Iterable[tuple[str, str, int]]],
                 index_blocks: Callable[[str], int]) -> None:
        self.workers = workers  # (role, address, polls)
        self.index_blocks = index_blocks

    def collect(self) -> Iterator[Metric]:
        polls = CounterMetricFamily("pdserve_router_worker_polls",
                                    "Stats polls a worker has answered (KV events applied).",
                                    labels=["role", "worker"])
        blocks = GaugeMetricFamily("pdserve_router_kv_index_blocks",
                                   "Distinct KV blocks the router's index holds for a worker.",
                                   labels=["role", "worker"])
        for role, address, n in self.workers():
            polls.add_metric([role, address], float(n))
            blocks.add_metric([role, address], float(self.index_blocks(address)))
        yield polls
        yield blocks


class FrontCollector(Collector):
    """Read on each scrape: gRPC messages the front refused from their length prefix."""

    def __init__(self, refusals: Callable[[], int]) -> None:
        self.refusals = refusals

    def collect(self) -> Iterator[Metric]:
        fam = CounterMetricFamily("pdserve_router_grpc_prefix_refusals",
                                  "gRPC messages over the receive limit, refused by the "
                                  "front from their length prefix.")
        fam.add_metric([], float(self.refusals()))
        yield fam


class FlowCounterCollector(Collector):
    """The router flow's cumulative counters as Prometheus counters (absent keys read 0)."""

    def __init__(self, counters: Callable[[], Mapping[str, float]]) -> None:
        self.counters = counters

    def collect(self) -> Iterator[Metric]:
        values = self.counters()
        for key, (name, doc) in FLOW_COUNTERS.items():
            fam = CounterMetricFamily(name, doc)
            fam.add_metric([], float(values.get(key, 0)))
            yield fam
        fam = CounterMetricFamily("pdserve_router_migrations_by_cause",
                                  "Requests moved to another worker, by what failed them.",
                                  labels=["cause"])
        for cause in MIGRATION_CAUSES:
            fam.add_metric([cause], float(values.get(f"migrations.{cause}", 0)))
        yield fam


class RequestTrace:
    """One request's timestamps; reports to `RouterMetrics` and logs start and finish."""

    def __init__(self, metrics: RouterMetrics, request_id: str, prompt_tokens: int,
                 log: logging.Logger, clock: Callable[[], float], n: int = 1,
                 max_tokens: int = 0) -> None:
        self.metrics = metrics
        self.log = request_log(log, request_id)
        self.request_id = request_id
        self.clock = clock
        self.start = clock()
        self.first: float | None = None
        self.last: float | None = None
        self.tokens = 0
        self.prompt_tokens = prompt_tokens
        self.status: str | None = None
        """The final status once `finish` ran."""
        self.n, self.max_tokens = n, max_tokens
        metrics.waiting += 1
        metrics.inflight.inc()
        metrics.prompt_tokens.inc(prompt_tokens)
        self.log.info("request %s started: %d prompt tokens", request_id, prompt_tokens,
                      extra={"event": "request_start", "prompt_tokens": prompt_tokens})

    def on_tokens(self, n: int) -> None:
        """A chunk of `n` new tokens is about to be streamed to the client."""
        if n <= 0:
            return
        now = self.clock()
        if self.first is None:
            self.first = now
            self.metrics.ttft.observe(now - self.start)
            self.metrics.vllm.on_first_tokens(now - self.start, self.prompt_tokens, n)
            self.metrics.waiting -= 1
            self.metrics.running += 1
        elif self.last is not None:
            self.metrics.itl.observe(now - self.last)
            self.metrics.vllm.on_tokens(now - self.last, n)
        self.last = now
        self.tokens += n
        self.metrics.generation_tokens.inc(n)

    def finish(self, status: str, cached_tokens: int = 0, reason: str = "stop",
               prefill_compute_s: float = 0.0) -> None:
        """End the request with a gRPC status name (and, when OK, its finish reason);
        later calls are ignored."""
        if self.status is not None:
            return
        self.status = status
        now = self.clock()
        m = self.metrics
        m.inflight.dec()
        if self.first is None:
            m.waiting -= 1
        else:
            m.running -= 1
        ttft = None if self.first is None else self.first - self.start
        decode = 0.0 if self.first is None or self.last is None else self.last - self.first
        m.vllm.on_finished(FinishedRequest(
            reason if status == "OK" else "abort", now - self.start, ttft, decode,
            prefill_compute_s, self.prompt_tokens, self.tokens, self.n, self.max_tokens))
        m.requests.labels(status).inc()
        m.cached_tokens.inc(max(cached_tokens, 0))
        if status == "OK":
            m.e2e.observe(now - self.start)
            if self.tokens > 1 and self.first is not None and self.last is not None:
                m.tpot.observe((self.last - self.first) / (self.tokens - 1))
        ttft = None if self.first is None else round(self.first - self.start, 6)
        self.log.info("request %s finished: status=%s tokens=%d ttft_s=%s", self.request_id,
                      status, self.tokens, ttft,
                      extra={"event": "request_finish", "status": status,
                             "prompt_tokens": self.prompt_tokens, "tokens": self.tokens,
                             "cached_tokens": cached_tokens, "ttft_s": ttft,
                             "e2e_s": round(now - self.start, 6)})


def status_of(exc: BaseException) -> str:
    """The gRPC status name a request ends with when `exc` stops it."""
    code = getattr(exc, "code", None)
    if isinstance(code, grpc.StatusCode):  # router.flow.FlowError
        return code.name
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        return grpc.StatusCode.CANCELLED.name  # the client went away
    return grpc.StatusCode.UNKNOWN.name
