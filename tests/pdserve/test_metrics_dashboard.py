"""The Grafana dashboard is valid JSON of a recent schema and queries only metrics pdserve
exports (so a renamed metric breaks this test, not a dashboard in production)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from pdserve.observability.router_metrics import RouterMetrics
from pdserve.observability.worker_metrics import WorkerCollector, WorkerSnapshot
from pdserve.observability.worker_requests import WorkerRequestMetrics

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "pdserve-dashboard.json"
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"),
             "summary": ("_count", "_sum"), "gauge": ("",)}


def exported_names() -> set[str]:
    reg = RouterMetrics().registry
    stats = {"num_running": 0, "num_waiting": 0, "queued_prefill_tokens": 0,
             "kv_blocks_total": 1, "kv_blocks_used": 0, "kv_blocks_cached": 0,
             "kv_tier_host_blocks": 0, "kv_tier_host_hits": 0, "kv_tier_host_bytes_out": 0,
             "kv_tier_host_read_bw": 0, "kv_tier_blocks_loaded_planned": 0}
    counters = {"prompt_tokens": 1, "kv_bytes": 1, "local_prefills": 1, "kv_transfers": 1}
    reg.register(WorkerCollector("prefill", "p", lambda: WorkerSnapshot(stats, counters, 1)))
    WorkerRequestMetrics(reg, "prefill", "p")
    return {fam.name + s for fam in reg.collect() for s in _SUFFIXES.get(fam.type, ("",))}


def load() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_dashboard_schema_and_datasource_variable():
    d = load()
    assert d["schemaVersion"] >= 36
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = [p for p in d["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in panels:
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], p["title"]


def test_dashboard_queries_only_exported_metrics():
    exported = exported_names()
    used = set()
    for p in load()["panels"]:
        for t in p.get("targets", []):
            used |= set(re.findall(r"pdserve_[a-z0-9_]+", t["expr"]))
    assert used, "the dashboard queries nothing"
    assert used <= exported, sorted(used - exported)


def test_dashboard_covers_the_required_views():
    exprs = " ".join(t["expr"] for p in load()["panels"] for t in p.get("targets", []))
    for needle in ("histogram_quantile(0.5, sum by (le) (rate(pdserve_request_ttft_seconds",
                   "histogram_quantile(0.99, sum by (le) (rate(pdserve_request_tpot_seconds",
                   "pdserve_generation_tokens_total", "pdserve_requests_total",
                   "pdserve_queue_depth", "pdserve_kv_blocks", "pdserve_prefix_hit_tokens_total",
                   "pdserve_kv_transfer_bytes_total", "pdserve_kv_transfer_seconds_sum",
                   "pdserve_spec_acceptance_rate"):
        assert needle in exprs, needle
