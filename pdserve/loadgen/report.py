"""A benchmark's report: summaries overall and per request class, as JSON and as a table.

The JSON (schema `REPORT_SCHEMA`) holds the run's configuration, the overall `Summary`, one
per request class (`by_kind`), and every request (offset of its send from the run's first send,
its latencies and ITL samples in ms, its error), so plots can be redrawn from the file alone.
`check_report` validates that shape; bump the schema when it changes.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.loadgen.metrics import Distribution, Slo, Summary, request_metrics, summarize
from pdserve.loadgen.records import RequestResult
from pdserve.loadgen.runner import RunResult

REPORT_SCHEMA = "pdserve.bench/v1"
"""v1: first version."""

LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
_DISTRIBUTION_KEYS = frozenset(f.name for f in dataclasses.fields(Distribution))
_SUMMARY_KEYS = frozenset(f.name for f in dataclasses.fields(Summary))
_REQUEST_KEYS = frozenset({"kind", "prompt_len", "output_tokens", "cached_tokens", "error",
                           "error_detail", "send_offset_s", "ttft_ms", "tpot_ms", "e2e_ms",
                           "itl_ms"})


@dataclass(frozen=True)
class Report:
    config: Mapping[str, Any]
    """The run's settings (JSON-ready), echoed into the report."""
    slos: tuple[Slo, ...]
    run: RunResult
    overall: Summary
    by_kind: Mapping[str, Summary]


def make_report(run: RunResult, slos: Sequence[Slo], config: Mapping[str, Any]) -> Report:
    kinds = sorted({r.kind for r in run.results})
    by_kind = {k: summarize([r for r in run.results if r.kind == k], run.duration_s, slos)
               for k in kinds}
    return Report(dict(config), tuple(slos), run, summarize(run.results, run.duration_s, slos),
                  by_kind)


def to_json(report: Report) -> dict[str, Any]:
    first = min((r.send_time for r in report.run.results), default=0.0)
    return {
        "schema": REPORT_SCHEMA,
        "config": dict(report.config),
        "slos": {s.metric.value: s.limit_ms for s in report.slos},
        "warmup_errors": report.run.warmup_errors,
        "summary": dataclasses.asdict(report.overall),
        "by_kind": {k: dataclasses.asdict(s) for k, s in report.by_kind.items()},
        "requests": [_request_json(r, first) for r in report.run.results],
    }


def write_report(report: Report, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_json(report), indent=1, allow_nan=False))
    return path


def check_report(data: Any) -> None:
    """Raises ValueError naming the first part of data that does not follow the schema."""
    if not isinstance(data, dict) or data.get("schema") != REPORT_SCHEMA:
        raise ValueError(f"schema: expected {REPORT_SCHEMA!r}")
    for key in ("config", "slos", "summary", "by_kind", "requests"):
        if key not in data:
            raise ValueError(f"{key}: missing")
    for name, summary in [("summary", data["summary"]),
                          *((f"by_kind.{k}", s) for k, s in data["by_kind"].items())]:
        _check_keys(name, summary, _SUMMARY_KEYS)
        for lat in LATENCIES:
            _check_keys(f"{name}.{lat}", summary[lat], _DISTRIBUTION_KEYS)
    for i, request in enumerate(data["requests"]):
        _check_keys(f"requests[{i}]", request, _REQUEST_KEYS)


def format_report(report: Report) -> str:
    s = report.overall
    lines = ["=" * 22 + " pdserve bench " + "=" * 22,
             f"{'duration':<24}{s.duration_s:.2f} s",
             f"{'completed / failed':<24}{s.completed} / {s.failed}"]
    for status, count in s.errors.items():
        example = s.error_examples.get(status, "")
        example = f"  (e.g. {example[:100]})" if example else ""
        lines.append(f"{'errors':<24}{status}: {count}{example}")
    lines += [f"{'input tokens':<24}{s.input_tokens} ({s.cached_tokens} cached)",
              f"{'output tokens':<24}{s.output_tokens}",
              f"{'request throughput':<24}{s.request_throughput:.3f} req/s",
              f"{'output throughput':<24}{s.output_throughput:.1f} tok/s"]
    if s.goodput is not None:
        slos = ", ".join(f"{x.metric.value} <= {x.limit_ms:g} ms" for x in report.slos)
        lines.append(f"{'goodput':<24}{s.goodput:.3f} req/s  ({slos}; "
                     f"{100 * (s.slo_attainment or 0):.0f}% of requests)")
    lines += _latency_table("all requests", s)
    if len(report.by_kind) > 1:
        for kind, ks in report.by_kind.items():
            good = f", goodput {ks.goodput:.3f} req/s" if ks.goodput is not None else ""
            lines += _latency_table(f"{kind}: {ks.completed} completed, {ks.failed} failed{good}",
                                    ks)
    return "\n".join(lines)


def _latency_table(title: str, s: Summary) -> list[str]:
    head = f"{'latency (ms)':<14}" + "".join(f"{c:>10}" for c in ("mean", "p50", "p90", "p99"))
    rows = [f"--- {title} ---", head]
    for name in LATENCIES:
        d: Distribution = getattr(s, name)
        cells = (d.mean, d.p50, d.p90, d.p99)
        rows.append(f"{name[:-3].upper():<14}" + "".join(f"{_ms(v):>10}" for v in cells))
    return rows


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _request_json(r: RequestResult, first_send: float) -> dict[str, Any]:
    m = request_metrics(r)
    return {"kind": r.kind, "prompt_len": r.prompt_len, "output_tokens": r.output_tokens,
            "cached_tokens": r.cached_tokens, "error": r.error, "error_detail": r.error_detail,
            "send_offset_s": r.send_time - first_send,
            "ttft_ms": m.ttft * 1e3 if m else None,
            "tpot_ms": m.tpot * 1e3 if m and m.tpot is not None else None,
            "e2e_ms": m.e2e * 1e3 if m else None,
            "itl_ms": [x * 1e3 for x in m.itl] if m else []}


def _check_keys(name: str, value: Any, keys: frozenset[str]) -> None:
    if not isinstance(value, dict):
        raise ValueError(f"{name}: expected an object")
    missing = sorted(keys - value.keys())
    if missing:
        raise ValueError(f"{name}: missing {', '.join(missing)}")
