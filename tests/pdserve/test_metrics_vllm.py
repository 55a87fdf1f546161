"""vLLM's metric names beside pdserve's: the same observations under `vllm:*`, labelled
model_name, the types vLLM gives them, a valid exposition (promtool when installed)."""

from __future__ import annotations

import logging
import shutil
import subprocess

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.observability.router_metrics import RouterMetrics
from pdserve.observability.vllm_metrics import ClusterCollector, ClusterState, worker_state
from pdserve.observability.worker_metrics import WorkerSnapshot, worker_families
from tests.pdserve.test_metrics_router import Clock

MODEL = {"model_name": "smol"}


def families(registry) -> dict:
    return {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}


def one_request(m: RouterMetrics, clock: Clock, tokens: int = 5, prompt: int = 7) -> None:
    t = m.trace("r", prompt, logging.getLogger("t"), clock, n=1, max_tokens=tokens)
    for _ in range(tokens):
        clock.now += 0.1
        t.on_tokens(1)
    t.finish("OK", 0, "length", prefill_compute_s=0.04)


def test_request_metrics_under_vllms_names():
    m, clock = RouterMetrics(model_name="smol"), Clock()
    for _ in range(3):
        one_request(m, clock)
    v = lambda name, **labels: m.registry.get_sample_value(name, {**MODEL, **labels})  # noqa
    assert v("vllm:time_to_first_token_seconds_count") == 3
    assert v("vllm:inter_token_latency_seconds_count") == 3 * 4  # one per token after the first
    assert v("vllm:e2e_request_latency_seconds_count") == 3
    assert v("vllm:request_time_per_output_token_seconds_count") == 3
    assert v("vllm:prompt_tokens_total") == 21 and v("vllm:generation_tokens_total") == 15
    assert v("vllm:request_success_total", finished_reason="length") == 3
    assert v("vllm:request_success_total", finished_reason="stop") is None  # none yet
    assert v("vllm:request_prompt_tokens_sum") == 21
    assert v("vllm:request_generation_tokens_sum") == 15
    assert v("vllm:request_params_max_tokens_sum") == 15
    assert v("vllm:request_params_n_count") == 3
    assert v("vllm:iteration_tokens_total_sum") == 3 * (7 + 5)
    assert v("vllm:iteration_tokens_total_count") == 3 * 5
    assert v("vllm:request_prefill_time_seconds_sum") == pytest.approx(3 * 0.04)
    assert v("vllm:request_queue_time_seconds_sum") == pytest.approx(3 * 0.06)
    fams = families(m.registry)
    assert fams["vllm:time_to_first_token_seconds"].type == "histogram"
    assert fams["vllm:prompt_tokens"].type == "counter"
    assert fams["vllm:request_success"].type == "counter"


def test_cluster_state_families_and_live_request_counts():
    m, clock = RouterMetrics(model_name="smol"), Clock()
    t = m.trace("r", 4, logging.getLogger("t"), clock)
    state = lambda: ClusterState(m.running, m.waiting, 30, 120, 100.0, 40.0, 2.0, 16)  # noqa
    m.registry.register(ClusterCollector("smol", state))
    fams = families(m.registry)
    sample = lambda name: fams[name].samples[0]  # noqa: E731
    assert sample("vllm:num_requests_waiting").value == 1
    assert sample("vllm:num_requests_running").value == 0
    t.on_tokens(1)
    fams = families(m.registry)
    assert sample("vllm:num_requests_running").value == 1
    assert sample("vllm:kv_cache_usage_perc").value == 0.25
    assert fams["vllm:kv_cache_usage_perc"].type == "gauge"
    assert sample("vllm:prefix_cache_queries").name == "vllm:prefix_cache_queries_total"
    assert sample("vllm:prefix_cache_hits").value == 40
    assert sample("vllm:num_preemptions").value == 2
    assert sample("vllm:cache_config_info").labels["block_size"] == "16"
    assert all(f.samples[0].labels["model_name"] == "smol" for n, f in fams.items()
               if n.startswith("vllm:") and f.samples)
    t.finish("CANCELLED")
    fams = families(m.registry)
    assert sample("vllm:num_requests_running").value == 0


def test_workers_export_their_engine_state_under_vllms_names():
    stats = {"num_running": 2, "num_waiting": 1, "kv_blocks_used": 5, "kv_blocks_total": 10,
             "queued_prefill_tokens": 0, "kv_blocks_cached": 0, "prefix_cache_queries": 9,
             "prefix_cache_hits": 3, "num_preemptions": 0}
    out = worker_families({"component": "decode", "worker": "d0"},
                          WorkerSnapshot(stats, {}, 1, "smol", 16))
    by_name = {f.name: f for f in out}
    assert by_name["vllm:num_requests_running"].samples[0].value == 2
    assert by_name["vllm:kv_cache_usage_perc"].samples[0].value == 0.5
    assert worker_state(None).kv_blocks_total == 0


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_the_exposition_passes_promtool():
    m, clock = RouterMetrics(model_name="smol"), Clock()
    one_request(m, clock)
    m.registry.register(ClusterCollector(
        "smol", lambda: ClusterState(0, 0, 1, 2, 3.0, 1.0, 0.0, 16)))
    worker = CollectorRegistry()
    text = generate_latest(m.registry) + generate_latest(worker)
    done = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True,
                          timeout=60)
    lines = (done.stdout + done.stderr).decode().splitlines()
    # vLLM's names carry a colon, which promtool's style lint flags (colons are meant for
    # recording rules), and vLLM names one histogram iteration_tokens_total: both are
    # vLLM's names, kept for its dashboards. Anything else (a parse error, a bad type) fails.
    problems = [line for line in lines if "should not contain ':'" not in line
                and not line.startswith("vllm:iteration_tokens_total non-counter")]
    assert problems == [], problems
