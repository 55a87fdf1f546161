"""Report JSON schema, the printed table, and the PNG plots (when matplotlib is installed)."""

from __future__ import annotations

import json
import sys

import pytest

from pdserve.loadgen.metrics import parse_slos
from pdserve.loadgen.plots import PlotUnavailable, latency_cdfs, metrics_vs_rate
from pdserve.loadgen.records import Arrival, RequestResult
from pdserve.loadgen.report import (
    REPORT_SCHEMA,
    check_report,
    format_report,
    make_report,
    to_json,
    write_report,
)
from pdserve.loadgen.runner import RunResult

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _result(kind, send, times, error=None):
    arrivals = tuple(Arrival(t, 1) for t in times)
    return RequestResult(kind, 20, send, times[-1] if times else send, arrivals, len(times),
                         0, error, "client went away" if error else None)


@pytest.fixture
def report():
    results = (_result("long", 0.0, [1.0, 1.1, 1.2]), _result("long", 0.5, [2.0, 2.05]),
               _result("short", 0.1, [0.2, 0.3, 0.4, 0.5]), _result("short", 0.2, [], "CANCELLED"))
    run = RunResult(results, duration_s=3.0, warmup_errors=0)
    return make_report(run, parse_slos(["ttft:500"]), {"dataset": "mixed", "seed": 0})


def test_report_json_follows_the_schema_and_round_trips(report, tmp_path):
    data = json.loads(write_report(report, tmp_path / "r.json").read_text())
    check_report(data)
    assert data["schema"] == REPORT_SCHEMA
    assert data["slos"] == {"ttft": 500.0}
    assert set(data["by_kind"]) == {"long", "short"}
    assert data["summary"]["completed"] == 3 and data["summary"]["errors"] == {"CANCELLED": 1}
    assert data["by_kind"]["short"]["failed"] == 1
    assert data["summary"]["goodput"] == pytest.approx(1 / 3.0)  # only the short one: TTFT 100
    first = data["requests"][0]
    assert first["send_offset_s"] == 0.0 and first["ttft_ms"] == pytest.approx(1000.0)
    assert first["itl_ms"] == pytest.approx([100.0, 100.0])
    failed = data["requests"][3]
    assert failed["ttft_ms"] is None and failed["error"] == "CANCELLED"
    assert failed["error_detail"] == "client went away"


@pytest.mark.parametrize("breaker", [
    lambda d: d.pop("summary"),
    lambda d: d.update(schema="other"),
    lambda d: d["summary"].pop("goodput"),
    lambda d: d["by_kind"]["long"]["tpot_ms"].pop("p99"),
    lambda d: d["requests"][1].pop("e2e_ms"),
])
def test_check_report_refuses_a_broken_report(report, breaker):
    data = to_json(report)
    breaker(data)
    with pytest.raises(ValueError):
        check_report(data)


def test_table_shows_every_latency_and_each_class(report):
    text = format_report(report)
    for word in ("TTFT", "TPOT", "ITL", "E2E", "goodput", "CANCELLED: 1  (e.g. client went away)",
                 "long:", "short:"):
        assert word in text
    assert "3 / 1" in text  # completed / failed


def test_latency_cdf_png(report, tmp_path):
    pytest.importorskip("matplotlib")
    path = latency_cdfs(to_json(report), tmp_path / "plots" / "cdf.png")
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_metrics_vs_rate_png(tmp_path):
    pytest.importorskip("matplotlib")
    series = {"a": [{"rate": 0.1, "goodput": 0.1}, {"rate": 0.2, "goodput": None}],
              "b": [{"rate": 0.1, "goodput": 0.05}, {"rate": 0.2, "goodput": 0.1}]}
    path = metrics_vs_rate(series, [("goodput", "goodput (req/s)")], tmp_path / "g.png", "t")
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_plots_without_matplotlib_say_what_to_install(report, tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    with pytest.raises(PlotUnavailable, match="pip install matplotlib"):
        latency_cdfs(to_json(report), tmp_path / "cdf.png")
    assert not (tmp_path / "cdf.png").exists()
