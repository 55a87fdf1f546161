"""Disaggregated vs colocated serving: same cores, same model, same workload.

    python bench/disagg_vs_colocated.py [--model default|demo|PATH] [--rates 0.025,0.05,0.075]
        [--duration 60] [--cores 2]
        [--long-len 2048] [--slo-ttft-ms 20000] [--slo-tpot-ms 200] [--output ...json]

Two systems, each a router plus workers on this machine with the same total thread budget:

- colocated: one decode worker doing both phases (`num_prefill=0`), `--cores` threads;
- disaggregated: one prefill worker and one decode worker, `--cores / 2` threads each.

Workload (`pdserve.loadgen` dataset `mixed`): long prompts (default 1.5k-2.5k tokens, 8-token
answers) arriving as a Poisson process at each rate, for about `--duration` seconds, while a steady
population of short-prompt, long-decode requests (32 -> 128 tokens, 4 in flight) keeps the
decode batch busy. Short prompts stay under the router's local-prefill threshold, so in the
disaggregated system only the long prompts go to the prefill worker. Each system serves every
rate on one cluster, after one warm-up.

Reported per system and rate: goodput (requests/s meeting both the TTFT and the TPOT SLO, both
classes counted; the steady decodes are most of the requests) and the long prompts' own goodput;
the long prompts' TTFT p50/p99; TPOT p99 over all requests and over the steady decodes; the
steady decodes' ITL p99 (where a prefill stalling the decode batch shows first); how many long
prompts the router sent to the prefill worker (`long_via_P`: the others were prefilled on the
decode worker, the router's fallback while the prefill pool is empty); failures. Then the
disaggregated / colocated ratios. Writes JSON, and a PNG when matplotlib is installed; a
benchmark prints what it measured, nothing here asserts on timings.

Each rate uses its own seed (the same for both systems), so no prompt repeats across runs and
the prefix cache never helps. In the disaggregated system a long prompt's TPOT includes the wait
for its KV, which its TTFT does not (the prefill worker returns the first token at once).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


from bench.common import print_table, write_json  # noqa: E402
from pdserve.default_model import ensure_default_model  # noqa: E402
from pdserve.demo_model import ensure_demo_model  # noqa: E402
from pdserve.launcher import ClusterSpec, LocalCluster  # noqa: E402
from pdserve.loadgen.arrivals import ArrivalSpec  # noqa: E402
from pdserve.loadgen.backend import SendOptions  # noqa: E402
from pdserve.loadgen.datasets import MixedSpec, Workload, build_workload  # noqa: E402
from pdserve.loadgen.grpc_backend import GrpcBackend  # noqa: E402
from pdserve.loadgen.metrics import Slo, SloMetric  # noqa: E402
from pdserve.loadgen.report import Report, make_report  # noqa: E402
from pdserve.loadgen.runner import RunConfig, run_workload  # noqa: E402
from pdserve.proto import worker_pb, worker_pb_grpc  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
COLUMNS = ["system", "rate", "long_prompts", "long_via_P", "goodput", "long_goodput", "slo_pct",
           "ttft_p50_ms", "ttft_p99_ms", "tpot_p99_ms", "short_tpot_p99_ms", "short_itl_p99_ms",
           "failed"]
RATIO_KEYS = ["goodput", "ttft_p50_ms", "ttft_p99_ms", "tpot_p99_ms", "short_tpot_p99_ms",
              "short_itl_p99_ms"]


@dataclass(frozen=True)
class System:
    name: str
    num_prefill: int
    threads_per_worker: int


def systems(cores: int) -> tuple[System, System]:
    """The two systems on the same total number of worker threads."""
    return (System("colocated", 0, cores), System("disaggregated", 1, max(1, cores // 2)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default",
                   help="checkpoint dir or .gguf; 'default': the real default model "
                        "(SmolLM2-135M-Instruct); 'demo': the random demo model")
    p.add_argument("--rates", default="0.025,0.05,0.075",
                   help="long prompts per second, comma list")
    p.add_argument("--duration", type=float, default=60.0,
                   help="seconds of long-prompt arrivals per rate (sets how many are sent)")
    p.add_argument("--min-long", type=int, default=2, help="long prompts per rate, at least")
    p.add_argument("--long-len", type=int, default=2048, help="mean long prompt tokens")
    p.add_argument("--long-range", type=float, default=0.25,
                   help="long prompts uniform in [len*(1-r), len*(1+r)]")
    p.add_argument("--long-output", type=int, default=8)
    p.add_argument("--short-input", type=int, default=32)
    p.add_argument("--short-output", type=int, default=128)
    p.add_argument("--short-concurrency", type=int, default=4)
    p.add_argument("--local-prefill-tokens", type=int, default=64,
                   help="router threshold: shorter prompts are prefilled on the decode worker")
    p.add_argument("--cores", type=int, default=2, help="total worker threads of each system")
    p.add_argument("--slo-ttft-ms", type=float, default=20000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=200.0)
    p.add_argument("--worker-arg", action="append", default=[],
                   help="extra worker flag (repeatable): --worker-arg=--max-num-batched-tokens=512")
    p.add_argument("--systems", default="colocated,disaggregated", help="which to run")
    p.add_argument("--log-dir", default=None, help="keep worker logs here (default: discard)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=str(RESULTS / "disagg_vs_colocated.json"))
    p.add_argument("--plot", default=str(RESULTS / "disagg_vs_colocated.png"))
    a = p.parse_args(argv)
    a.rate_list = [float(r) for r in a.rates.split(",") if r.strip()]
    a.system_list = [s.strip() for s in a.systems.split(",") if s.strip()]
    known = [s.name for s in systems(a.cores)]
    if not a.rate_list or any(r <= 0 for r in a.rate_list):
        p.error("--rates: expected positive numbers")
    if not a.system_list or set(a.system_list) - set(known):
        p.error(f"--systems: expected a comma list of {', '.join(known)}")
    return a


def mixed_spec(a: argparse.Namespace, rate: float) -> MixedSpec:
    return MixedSpec(num_prompts=max(a.min_long, round(rate * a.duration)),
                     input_len=a.long_len, output_len=a.long_output, range_ratio=a.long_range,
                     short_input_len=a.short_input, short_output_len=a.short_output,
                     short_concurrency=a.short_concurrency)


def cluster_spec(system: System, model: str, a: argparse.Namespace, logs: str) -> ClusterSpec:
    threads = system.threads_per_worker
    return ClusterSpec(
        model=model, port=0, num_prefill=system.num_prefill, num_decode=1,
        threads_per_worker=threads, worker_args=("--dtype", "float32", *a.worker_arg),
        router_args=("--local-prefill-tokens", str(a.local_prefill_tokens), "--http-port", "-1"),
        log_dir=f"{logs}/{system.name}", env={"OMP_NUM_THREADS": str(threads)})


def remote_prefills(cluster: LocalCluster) -> int:
    """Prompts the decode workers got prefilled by a prefill worker, so far."""
    total = 0
    for w in cluster.workers("decode"):
        with cluster.security.channel(w.info["address"]) as ch:
            stats = worker_pb_grpc.WorkerStub(ch).GetStats(worker_pb.StatsRequest(), timeout=30)
        total += int(stats.counters["remote_prefills"])
    return total


async def measure(cluster: LocalCluster, a: argparse.Namespace,
                  slos: tuple[Slo, ...]) -> list[tuple[Report, int]]:
    """Every rate against one cluster, after one warm-up: each run's report and how many of
    its prompts were prefilled by a prefill worker."""
    backend = GrpcBackend(cluster.address, SendOptions(timeout_s=900.0))
    first = mixed_spec(a, a.rate_list[0])
    warm_long = build_workload(replace(first, num_prompts=1), a.seed + 10_000)
    warmup = (*warm_long.requests, warm_long.steady.request(10**6)) if warm_long.steady \
        else warm_long.requests
    reports = []
    try:
        await asyncio.gather(*(backend.send(r) for r in warmup))
        for i, rate in enumerate(a.rate_list):
            # A seed per rate: no prompt repeats across runs, so no run hits the prefix cache.
            seed = a.seed + i
            workload: Workload = build_workload(mixed_spec(a, rate), seed)
            t0, remote0 = time.perf_counter(), remote_prefills(cluster)
            run = await run_workload(backend, workload, RunConfig(ArrivalSpec(rate), None, seed))
            print(f"  rate {rate:g}/s: {len(workload.requests)} long prompts, "
                  f"{time.perf_counter() - t0:.0f}s", flush=True)
            remote = remote_prefills(cluster) - remote0
            reports.append((make_report(run, slos, {"rate": rate}), remote))
    finally:
        await backend.close()
    return reports


def point(system: str, rate: float, report: Report, remote: int) -> dict:
    s = report.overall
    long = report.by_kind["long"]
    short = report.by_kind.get("short")  # absent with --short-concurrency 0
    return {"system": system, "rate": rate, "long_prompts": long.completed + long.failed,
            "long_via_P": remote,
            "goodput": s.goodput, "long_goodput": long.goodput,
            "slo_pct": 100 * (s.slo_attainment or 0.0),
            "ttft_p50_ms": long.ttft_ms.p50, "ttft_p99_ms": long.ttft_ms.p99,
            "tpot_p99_ms": s.tpot_ms.p99,
            "short_tpot_p99_ms": short.tpot_ms.p99 if short else None,
            "short_ttft_p99_ms": short.ttft_ms.p99 if short else None,
            "short_itl_p99_ms": short.itl_ms.p99 if short else None,
            "failed": s.failed, "errors": s.errors, "error_examples": s.error_examples,
            "output_throughput": s.output_throughput, "duration_s": s.duration_s}


def ratios(points: list[dict]) -> list[dict]:
    """disaggregated / colocated per rate, for each key of RATIO_KEYS."""
    by = {(p["system"], p["rate"]): p for p in points}
    out = []
    for rate in sorted({p["rate"] for p in points}):
        d, c = by.get(("disaggregated", rate)), by.get(("colocated", rate))
        if d and c:
            out.append({"rate": rate, **{k: (d[k] / c[k] if d[k] is not None and c[k] else None)
                                         for k in RATIO_KEYS}})
    return out


def plot(points: list[dict], path: str) -> str | None:
    from pdserve.loadgen.plots import PlotUnavailable, metrics_vs_rate

    series: dict[str, list[dict]] = {}
    for p in points:
        series.setdefault(p["system"], []).append(p)
    panels = [("goodput", "goodput (req/s)"), ("tpot_p99_ms", "TPOT p99 (ms)"),
              ("ttft_p99_ms", "long-prompt TTFT p99 (ms)"), ("failed", "failed requests")]
    try:
        return str(metrics_vs_rate(series, panels, path, "disaggregated vs colocated"))
    except PlotUnavailable as exc:
        print(f"no plot: {exc}", file=sys.stderr)
        return None


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    model = {"default": lambda: str(ensure_default_model()),
             "demo": lambda: str(ensure_demo_model())}.get(a.model, lambda: a.model)()
    slos = (Slo(SloMetric.TTFT, a.slo_ttft_ms), Slo(SloMetric.TPOT, a.slo_tpot_ms))
    points, by_kind = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        logs = a.log_dir or tmp
        for system in [s for s in systems(a.cores) if s.name in a.system_list]:
            print(f"{system.name}: starting", flush=True)
            with LocalCluster(cluster_spec(system, model, a, logs)) as cluster:
                reports = asyncio.run(measure(cluster, a, slos))
            for rate, (report, remote) in zip(a.rate_list, reports, strict=True):
                points.append(point(system.name, rate, report, remote))
                by_kind[f"{system.name}@{rate:g}"] = {
                    k: dataclasses.asdict(v) for k, v in report.by_kind.items()}
    print(f"\nSLOs: TTFT <= {a.slo_ttft_ms:g} ms, TPOT <= {a.slo_tpot_ms:g} ms "
          f"(goodput counts both classes)")
    print_table(points, COLUMNS)
    rows = ratios(points)
    if rows:
        print("\ndisaggregated / colocated")
        print_table(rows, ["rate", *RATIO_KEYS])
    config = {k: v for k, v in vars(a).items() if k not in ("rate_list", "system_list")}
    config["model"] = model
    png = plot(points, a.plot)
    path = write_json(a.output, {"config": config, "points": points, "ratios": rows,
                                 "by_kind": by_kind, "plot": png})
    print(f"\nwrote {path}" + (f" and {png}" if png else ""))


if __name__ == "__main__":
    main()
