"""`pdserve bench` against a real cluster on the tiny checkpoint, over gRPC and over HTTP."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdserve.loadgen.report import check_report
from tests.helpers.checkpoints import VOCAB
from tests.helpers.cluster import start_cluster, wait_idle

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory):
    # --enable-prompt-tokens-details: the OpenAI usage reports cached tokens (vLLM's flag).
    c = start_cluster(tiny_llama, tmp_path_factory.mktemp("bench-cluster"),
                      router_args=("--enable-prompt-tokens-details",))
    yield c
    c.stop()


def _bench(*flags: str) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "pdserve", "bench", "--vocab-size", str(VOCAB),
                          "--no-progress", *flags], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out


def test_bench_over_grpc_with_poisson_arrivals_goodput_and_plots(cluster, tmp_path):
    out = _bench("--target", cluster.address, "--num-prompts", "8", "--request-rate", "20",
                 "--input-len", "40", "--output-len", "6", "--range-ratio", "0.5",
                 "--goodput", "ttft:60000", "tpot:60000", "--output", str(tmp_path / "r.json"),
                 "--plot-dir", str(tmp_path / "plots"))
    data = json.loads((tmp_path / "r.json").read_text())
    check_report(data)
    s = data["summary"]
    assert (s["completed"], s["failed"]) == (8, 0)
    requests = data["requests"]
    assert len(requests) == 8 and all(r["error"] is None for r in requests)
    assert all(20 <= r["prompt_len"] <= 60 for r in requests)
    assert s["output_tokens"] == sum(r["output_tokens"] for r in requests)
    assert all(r["ttft_ms"] <= r["e2e_ms"] for r in requests)
    assert s["goodput"] == pytest.approx(s["request_throughput"])  # SLOs nobody can miss
    assert "TTFT" in out.stdout and "goodput" in out.stdout
    if _has_matplotlib():
        assert (tmp_path / "plots" / "latency_cdf.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_over_grpc_with_a_steady_decode_population(cluster, tmp_path):
    _bench("--target", cluster.address, "--dataset", "mixed", "--num-prompts", "4",
           "--request-rate", "10", "--input-len", "120", "--output-len", "2",
           "--short-input-len", "8", "--short-output-len", "12", "--short-concurrency", "2",
           "--output", str(tmp_path / "m.json"))
    data = json.loads((tmp_path / "m.json").read_text())
    check_report(data)
    assert data["by_kind"]["long"]["completed"] == 4
    assert data["by_kind"]["short"]["completed"] >= 2
    assert data["summary"]["failed"] == 0
    assert not any(wait_idle(cluster).values())


def test_bench_over_the_openai_api_with_shared_prefixes(cluster, tmp_path):
    _bench("--openai-url", f"http://{cluster.http_address}/v1", "--dataset", "prefix",
           "--num-prompts", "8", "--concurrency", "1", "--num-prefixes", "2",
           "--prefix-len", "64", "--turns", "2", "--input-len", "16", "--output-len", "4",
           "--output", str(tmp_path / "p.json"))
    data = json.loads((tmp_path / "p.json").read_text())
    check_report(data)
    s = data["summary"]
    assert (s["completed"], s["failed"]) == (8, 0)
    assert s["output_tokens"] == 32
    # One at a time: later turns and conversations reuse system prompts already cached.
    assert s["cached_tokens"] > 0


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True
