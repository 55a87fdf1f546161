"""vLLM's metric names, beside pdserve's own, so vLLM dashboards, KEDA/HPA recipes and
routers that scrape `vllm:*` series work unchanged. Every family carries `model_name`.

Router side (`VllmRequestMetrics`, fed by each request's trace):

    vllm:time_to_first_token_seconds       histogram  arrival -> first token
    vllm:inter_token_latency_seconds       histogram  gap between a request's token batches
    vllm:e2e_request_latency_seconds       histogram  arrival -> last token (finished)
    vllm:request_time_per_output_token_seconds  histogram  mean gap after the first token
    vllm:request_queue_time_seconds        histogram  TTFT minus the prefill's compute
    vllm:request_prefill_time_seconds      histogram  prefill compute (remote: on P; local:
                                                      the whole TTFT)
    vllm:request_decode_time_seconds       histogram  first -> last token
    vllm:request_inference_time_seconds    histogram  prefill + decode
    vllm:request_prompt_tokens             histogram  per finished request
    vllm:request_generation_tokens         histogram  per finished request
    vllm:request_params_n / _max_tokens    histogram  per finished request
    vllm:iteration_tokens_total            histogram  tokens per engine step, as seen per
                                                      request (the prompt counts in its first)
    vllm:prompt_tokens_total, vllm:generation_tokens_total              counters
    vllm:request_success_total{finished_reason}                          counter

Cluster state (`ClusterCollector`, from the router's live requests and its workers' stats):

    vllm:num_requests_running   requests past their first token (decoding)
    vllm:num_requests_waiting   requests admitted without a first token yet (queued/prefill)
    vllm:kv_cache_usage_perc    decode pool KV blocks used / total (0..1)
    vllm:prefix_cache_queries_total / vllm:prefix_cache_hits_total   prompt tokens looked up
                                in / found in the workers' prefix caches
    vllm:num_preemptions_total  preemptions on every worker
    vllm:cache_config_info      block size, KV blocks, prefix caching (labels, value 1)

Workers export the engine-state ones for themselves too (`worker_families`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_GAP_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                     5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000,
                        50000, 100000)
_N_BUCKETS = (1, 2, 5, 10, 20)
LABEL = "model_name"


class VllmRequestMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model = model_name
        r, m = registry, [LABEL]

        def hist(name: str, doc: str, buckets) -> Histogram:
            h = Histogram(f"vllm:{name}", doc, m, buckets=buckets, registry=r)
            h.labels(model_name)  # present at 0 before the first request
            return h

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.",
                         LATENCY_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between a request's token "
                        "batches.", TOKEN_GAP_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency.",
                        LATENCY_BUCKETS)
        self.tpot = hist("request_time_per_output_token_seconds", "Mean time per output "
                         "token after the first, per request.", TOKEN_GAP_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Time a request waited before its "
                          "prefill computed.", LATENCY_BUCKETS)
        self.prefill = hist("request_prefill_time_seconds", "Time a request spent in "
                            "prefill.", LATENCY_BUCKETS)
        self.decode = hist("request_decode_time_seconds", "Time a request spent in decode.",
                           LATENCY_BUCKETS)
        self.inference = hist("request_inference_time_seconds", "Prefill plus decode time.",
                              LATENCY_BUCKETS)
        self.prompt_hist = hist("request_prompt_tokens", "Prompt tokens per request.",
                                _TOKEN_COUNT_BUCKETS)
        self.gen_hist = hist("request_generation_tokens", "Generated tokens per request.",
                             _TOKEN_COUNT_BUCKETS)
        self.n_param = hist("request_params_n", "The n parameter of requests.", _N_BUCKETS)
        self.max_tokens = hist("request_params_max_tokens", "The max_tokens parameter of "
                               "requests.", _TOKEN_COUNT_BUCKETS)
        self.iteration = hist("iteration_tokens_total", "Tokens per engine step, per "
                              "request.", _TOKEN_COUNT_BUCKETS)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.", m,
                                     registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generation tokens "
                                         "processed.", m, registry=r)
        self.success = Counter("vllm:request_success", "Finished requests, by finish "
                               "reason.", [LABEL, "finished_reason"], registry=r)
        # The success series appear with their first request (vLLM's dashboards sum them);
        # the token counters are present at 0 from the start.
        self.prompt_tokens.labels(model_name)
        self.generation_tokens.labels(model_name)

    def on_first_tokens(self, ttft_s: float, prompt_tokens: int, n: int) -> None:
        self.ttft.labels(self.model).observe(ttft_s)
        self.prompt_tokens.labels(self.model).inc(prompt_tokens)
        self.iteration.labels(self.model).observe(prompt_tokens + n)
        self.generation_tokens.labels(self.model).inc(n)

    def on_tokens(self, gap_s: float, n: int) -> None:
        self.itl.labels(self.model).observe(gap_s)
        self.iteration.labels(self.model).observe(n)
        self.generation_tokens.labels(self.model).inc(n)

    def on_finished(self, f: FinishedRequest) -> None:
        m = self.model
        self.success.labels(m, f.reason).inc()
        self.e2e.labels(m).observe(f.e2e_s)
        self.prompt_hist.labels(m).observe(f.prompt_tokens)
        self.gen_hist.labels(m).observe(f.generation_tokens)
        self.n_param.labels(m).observe(f.n)
        self.max_tokens.labels(m).observe(f.max_tokens)
        if f.ttft_s is None:
            return
        prefill = min(f.prefill_compute_s or f.ttft_s, f.ttft_s)
        self.queue.labels(m).observe(f.ttft_s - prefill)
        self.prefill.labels(m).observe(prefill)
        self.decode.labels(m).observe(f.decode_s)
        self.inference.labels(m).observe(prefill + f.decode_s)
        if f.generation_tokens > 1:
            self.tpot.labels(m).observe(f.decode_s / (f.generation_tokens - 1))


@dataclass(frozen=True)
class FinishedRequest:
    reason: str
    """stop | length | abort."""
    e2e_s: float
    ttft_s: float | None
    decode_s: float
    prefill_compute_s: float
    """The prefill worker's compute time (0: prefilled by the decode worker)."""
    prompt_tokens: int
    generation_tokens: int
    n: int
    max_tokens: int


@dataclass(frozen=True)
class ClusterState:
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_queries: float
    prefix_hits: float
    preemptions: float
    block_size: int = 0
    prefix_caching: bool = True


class ClusterCollector(Collector):
    """The engine-state families, read from `state()` on each scrape."""

    def __init__(self, model_name: str, state: Callable[[], ClusterState]) -> None:
        self.model = model_name
        self.state = state

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        return iter(state_families(self.model, self.state()))


def state_families(model_name: str, s: ClusterState) -> list[Metric]:
    def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(f"vllm:{name}", doc, labels=[LABEL])
        g.add_metric([model_name], value)
        return g

    def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(f"vllm:{name}", doc, labels=[LABEL])
        c.add_metric([model_name], value)
        return c

    usage = s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0
    info = GaugeMetricFamily("vllm:cache_config_info", "KV cache configuration.",
                             labels=[LABEL, "block_size", "num_gpu_blocks",
                                     "enable_prefix_caching"])
    info.add_metric([model_name, str(s.block_size), str(s.kv_blocks_total),
                     str(s.prefix_caching)], 1.0)
    return [
        gauge("num_requests_running", "Requests in model execution batches.", s.running),
        gauge("num_requests_waiting", "Requests waiting to be processed.", s.waiting),
        gauge("kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent.", usage),
        counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                s.prefix_queries),
        counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                s.prefix_hits),
        counter("num_preemptions", "Cumulative preemptions.", s.preemptions),
        info,
    ]


def worker_state(stats: Mapping[str, float] | None, block_size: int = 0,
                 prefix_caching: bool = True) -> ClusterState:
    """One worker's engine stats (`LLMEngine.stats()`) as vLLM's engine-state families."""
    s = stats or {}
    return ClusterState(int(s.get("num_running", 0)), int(s.get("num_waiting", 0)),
                        int(s.get("kv_blocks_used", 0)), int(s.get("kv_blocks_total", 0)),
                        s.get("prefix_cache_queries", 0.0), s.get("prefix_cache_hits", 0.0),
                        s.get("num_preemptions", 0.0), block_size, prefix_caching)
