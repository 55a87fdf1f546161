"""Observability end to end: `/metrics` on the router and on every worker moves when requests
are served, and the workers' JSON log lines carry the router's request id."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.client import Client
from tests.helpers.checkpoints import VOCAB
from tests.helpers.cluster import start_cluster
from tests.helpers.engine import random_prompts

pytestmark = pytest.mark.timeout(120)


def scrape(address: str) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=15) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def total(samples: dict, name: str, **labels) -> float:
    """Sum of `name`'s samples whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= lab)


def json_lines(path: Path) -> list[dict]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def test_metrics_move_and_logs_carry_request_ids(tiny_llama, tmp_path):
    cluster = start_cluster(tiny_llama, tmp_path, env={"PDSERVE_LOG_FORMAT": "json"})
    try:
        workers = {c.name: c.info["metrics_address"] for c in cluster.children}
        assert set(workers) == {"prefill-0", "decode-0"}
        before = {name: scrape(addr) for name, addr in workers.items()}
        router_before = scrape(cluster.http_address)

        long_prompt, short_prompt = random_prompts([120, 6], VOCAB, seed=7)
        with Client(cluster.address, max_retries=0) as client:
            long = client.generate(long_prompt, max_tokens=6, temperature=0.0,
                                   ignore_eos=True, request_id="obs-long")
            short = client.generate(short_prompt, max_tokens=4, temperature=0.0,
                                    ignore_eos=True, request_id="obs-short")
        assert (len(long.token_ids), len(short.token_ids)) == (6, 4)

        router = scrape(cluster.http_address)
        after = {name: scrape(addr) for name, addr in workers.items()}

        def moved(samples_after, samples_before, name, **labels):
            return total(samples_after, name, **labels) - total(samples_before, name, **labels)

        assert moved(router, router_before, "pdserve_request_ttft_seconds_count") == 2
        assert moved(router, router_before, "pdserve_requests_total", status="OK") == 2
        assert moved(router, router_before, "pdserve_generation_tokens_total") == 10
        assert moved(router, router_before, "pdserve_prompt_tokens_total") == 126
        assert moved(router, router_before, "pdserve_request_tpot_seconds_count") == 2
        assert total(router, "pdserve_requests_inflight") == 0
        # The flow's counters are exported (no tiers, one decode worker: nothing to hint/pull).
        assert ("pdserve_router_prefetch_hints_total", frozenset()) in router
        assert total(router, "pdserve_router_kv_pulls_routed_total") == 0
        decode = next(c for c in cluster.children if c.name == "decode-0").info["address"]
        assert total(router, "pdserve_router_worker_polls_total", worker=decode) > 0
        assert ("pdserve_router_kv_index_blocks",
                frozenset({("role", "decode"), ("worker", decode)})) in router
        for name in workers:
            assert moved(after[name], before[name], "pdserve_engine_steps_total") > 0, name
            assert total(after[name], "pdserve_engine_up") == 1
            assert total(after[name], "pdserve_kv_blocks", state="total") > 0
        p_after, p_before = after["prefill-0"], before["prefill-0"]
        assert moved(p_after, p_before, "pdserve_kv_transfer_bytes_total") > 0
        assert moved(p_after, p_before, "pdserve_worker_requests_total", rpc="Prefill",
                     status="OK") == 1
        d_after, d_before = after["decode-0"], before["decode-0"]
        assert moved(d_after, d_before, "pdserve_decode_admissions_total",
                     prefill="local") == 1
        assert moved(d_after, d_before, "pdserve_decode_admissions_total",
                     prefill="remote") == 1
        assert ("pdserve_kv_pulls_total", frozenset(
            {("component", "decode"), ("worker", "decode-0")})) in d_after
    finally:
        cluster.stop()

    logs = {name: json_lines(tmp_path / "logs" / f"{name}.log")
            for name in ("router", "prefill-0", "decode-0")}
    finished = {}
    for name, records in logs.items():
        assert records, f"{name} wrote no JSON log lines"
        for r in records:
            if r.get("event") == "request_finish":
                finished.setdefault(name, {})[r["request_id"].split("-")[1]] = r
    # The router's internal id starts with the client's id; the workers log the same id.
    long_id = finished["router"]["long"]["request_id"]
    assert long_id.startswith("obs-long-")
    assert finished["prefill-0"]["long"]["request_id"] == long_id
    assert finished["decode-0"]["long"]["request_id"] == long_id
    assert "short" not in finished["prefill-0"]  # a short prompt is prefilled by D itself
    assert finished["router"]["short"]["status"] == "OK"
    assert finished["router"]["long"]["tokens"] == 6
    assert {r["component"] for r in logs["decode-0"]} == {"decode"}
    assert {r["worker_id"] for r in logs["prefill-0"]} == {"prefill-0"}
