"""PNG plots of benchmark reports: latency CDFs, and metrics against the request rate.

Plots are drawn from report JSON (`report.to_json`), so they can be redrawn from a saved file.
matplotlib is optional: it is imported only here, on first use, and drawn with the Agg canvas
directly (no pyplot, no global backend switch); without it, `PlotUnavailable` says what to
install.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

CDF_PANELS = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"))


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def _figure(rows: int, cols: int, size: tuple[float, float]):
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotUnavailable("PNG plots need matplotlib: pip install matplotlib") from None
    fig = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(rows, cols, squeeze=False)


def latency_cdfs(report: Mapping[str, Any], path: str | Path) -> Path:
    """One PNG with the CDFs of TTFT, TPOT, ITL and E2E: all requests, and each class."""
    requests = [r for r in report["requests"] if r["error"] is None]
    kinds = sorted({r["kind"] for r in requests})
    groups = {"all": requests} if len(kinds) <= 1 else {
        "all": requests, **{k: [r for r in requests if r["kind"] == k] for k in kinds}}
    fig, axes = _figure(2, 2, (10, 7))
    for ax, (key, title) in zip(axes.flat, CDF_PANELS, strict=True):
        for label, group in groups.items():
            values = _values(group, key)
            if values:
                ys = [(i + 1) / len(values) for i in range(len(values))]
                ax.step(values, ys, where="post", label=f"{label} (n={len(values)})")
        ax.set_title(f"{title} CDF")
        ax.set_xlabel(f"{title} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize="small")
    return _save(fig, path)


def metrics_vs_rate(series: Mapping[str, Sequence[Mapping[str, float | None]]],
                    panels: Sequence[tuple[str, str]], path: str | Path, title: str = "") -> Path:
    """One panel per (key, label) in panels: each system's points {"rate": r, key: v, ...}
    against the request rate."""
    fig, axes = _figure(1, len(panels), (5 * len(panels), 4))
    for ax, (key, label) in zip(axes.flat, panels, strict=True):
        for system, points in series.items():
            xs = [p["rate"] for p in points if p.get(key) is not None]
            ys = [p[key] for p in points if p.get(key) is not None]
            ax.plot(xs, ys, marker="o", label=system)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def _values(requests: Sequence[Mapping[str, Any]], key: str) -> list[float]:
    if key == "itl_ms":
        return sorted(x for r in requests for x in r["itl_ms"])
    return sorted(r[key] for r in requests if r[key] is not None)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path
