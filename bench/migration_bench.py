"""Request migration, measured: what a dead or stopped worker costs clients that never retry.

    python bench/migration_bench.py [--requests 200] [--concurrency 8] [--max-tokens 16]
                                    [--stop-s 20] [--only decode_kill,...] [--model DIR]

Every scenario starts a fresh cluster of real processes (a tiny random Llama, float32, or
the checkpoint `--model` names, as its engine serves it; one thread per worker, the router's
default heartbeat: polled every 1 s, out after 3 s silent) and sends `--requests` streaming
`Generate` calls over plain gRPC, `--concurrency` at a time, no client retries. Prompts are
40-300 random tokens (all go through a prefill worker), half greedy, half seeded sampling
with penalties; every output is compared with the single-process engine's.

  baseline     1 prefill + 2 decode workers, no fault: the latencies to compare with
  decode_kill  the same; one decode worker SIGKILLed once 30% of the requests completed
  prefill_kill 2 prefill + 1 decode workers; one prefill worker SIGKILLed at 30%
  decode_stop  1 prefill + 2 decode workers; one decode worker SIGSTOPped at 30% for
               `--stop-s`, then SIGCONT (it must emit nothing into the moved streams)

Reported per scenario: OK / failed (by status), how many OK outputs equal the engine's,
migrations the router counted, p50/p99 request latency (and p99 over the baseline's), and the
longest wait a client saw between two chunks (or before the first): for decode_stop it must
stay under the heartbeat timeout plus one migration. The acceptance targets: >= 199 of 200
OK, every OK output identical. JSON in bench/results/migration_bench.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import print_table, write_json  # noqa: E402
from pdserve.launcher import ClusterSpec, LocalCluster  # noqa: E402
from router.config import RouterConfig  # noqa: E402
from tests.helpers.checkpoints import VOCAB, save_tiny  # noqa: E402
from tests.helpers.engine import random_prompts  # noqa: E402
from tests.helpers.faults import (  # noqa: E402
    Job,
    engine_outputs,
    migrations,
    mixed_jobs,
    run_jobs,
)

SCENARIOS = {  # name: (prefill workers, decode workers, fault)
    "baseline": (1, 2, None),
    "decode_kill": (1, 2, "kill decode"),
    "prefill_kill": (2, 1, "kill prefill"),
    "decode_stop": (1, 2, "stop decode"),
}


def _fault(cluster: LocalCluster, fault: str | None, done: list[int], at: int, stop_s: float,
           log: dict) -> threading.Thread | None:
    """A thread that waits until `at` requests completed, then applies the fault."""
    if fault is None:
        return None
    action, role = fault.split()
    victim = cluster.workers(role)[0]

    def run() -> None:
        while done[0] < at:
            time.sleep(0.01)
        log["at_completed"] = done[0]
        if action == "kill":
            cluster.kill(victim, signal.SIGKILL)
            return
        os.kill(victim.proc.pid, signal.SIGSTOP)
        time.sleep(stop_s)  # the fault itself lasts this long
        os.kill(victim.proc.pid, signal.SIGCONT)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def scenario(name: str, model: Path, jobs: list[Job], expected: list[list[int]],
             a: argparse.Namespace, tmp: Path) -> dict:
    prefill, decode, fault = SCENARIOS[name]
    spec = ClusterSpec(model=str(model), port=0, num_prefill=prefill, num_decode=decode,
                       threads_per_worker=1,
                       worker_args=() if a.model else ("--dtype", "float32"),
                       log_dir=str(tmp / name), env={"OMP_NUM_THREADS": "1"})
    with LocalCluster(spec) as cluster:
        asyncio.run(run_jobs(cluster.address, jobs[:4], concurrency=4))  # open every pair
        before = migrations(cluster)
        done, log = [0], {}
        latency: dict[int, float] = {}
        started: dict[int, float] = {}

        def on_chunk(i: int, out) -> None:
            started.setdefault(i, time.monotonic() - out.max_gap_s)
            if out.finish_reason:
                done[0] += 1
                latency[i] = time.monotonic() - started[i]

        side = _fault(cluster, fault, done, int(0.3 * len(jobs)), a.stop_s, log)
        t0 = time.monotonic()
        outcomes = asyncio.run(run_jobs(cluster.address, jobs, a.concurrency, on_chunk=on_chunk))
        wall = time.monotonic() - t0
        if side is not None:
            side.join(a.stop_s + 30)
        moved = migrations(cluster) - before
    ok = [i for i, o in enumerate(outcomes) if o.code.name == "OK"]
    failed: dict[str, int] = {}
    for o in outcomes:
        if o.code.name != "OK":
            failed[o.code.name] = failed.get(o.code.name, 0) + 1
    lat = sorted(latency.values()) or [0.0]
    return {"scenario": name, "requests": len(jobs), "ok": len(ok),
            "identical": sum(outcomes[i].tokens == expected[i] for i in ok),
            "failed": failed, "migrations": moved, "wall_s": wall,
            "p50_s": statistics.median(lat), "p99_s": lat[int(0.99 * (len(lat) - 1))],
            "max_wait_s": max(o.max_gap_s for o in outcomes), **log}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--stop-s", type=float, default=20.0)
    ap.add_argument("--only", default=",".join(SCENARIOS))
    ap.add_argument("--model", default=None,
                    help="checkpoint dir (default: a tiny random Llama, float32)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" /
                                         "migration_bench.json"))
    a = ap.parse_args()
    names = [n for n in a.only.split(",") if n]
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        model = (Path(a.model) if a.model
                 else save_tiny(tmp / "model", "llama", attention_bias=True))
        lengths = [40 + (37 * i) % 261 for i in range(a.requests)]
        jobs = mixed_jobs(random_prompts(lengths, VOCAB, seed=7), a.max_tokens)
        expected = engine_outputs(model, jobs)
        rows = [scenario(n, model, jobs, expected, a, tmp) for n in names]
    base = next((r for r in rows if r["scenario"] == "baseline"), None)
    for r in rows:
        r["p99_vs_baseline"] = r["p99_s"] / base["p99_s"] if base and base["p99_s"] else None
        r["failed_by_status"] = ", ".join(f"{k}={v}" for k, v in r["failed"].items()) or "-"
    hb = RouterConfig.heartbeat_timeout_s
    print(f"heartbeat: polled every {RouterConfig.health_period_s}s, out after {hb}s silent")
    print_table(rows, ["scenario", "requests", "ok", "identical", "failed_by_status",
                       "migrations", "p50_s", "p99_s", "p99_vs_baseline", "max_wait_s",
                       "wall_s"])
    path = write_json(a.out, {"args": vars(a), "heartbeat_timeout_s": hb, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
