"""The Ray controller's control plane: how fast `status` answers while nothing happens and while
a scale-up waits for a slow start (the baseline and the case, in one run: a ratio), and how
long the controller takes to replace a `kill -9`ed worker. A real raylet on this host (token
auth on), stand-in workers (tests/deploy/fake_worker.py) whose "model load" takes
--load-seconds, so the figures are the controller's own, not a model's.

    python bench/ray_control_bench.py [--calls 50] [--load-seconds 20] [--kills 3]

Prints a table; writes bench/results/ray_control.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import print_table  # noqa: E402
from tests.deploy.ray_nodes import RayNodes  # noqa: E402


def timed_status(d, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        d.status()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--load-seconds", type=float, default=20.0)
    p.add_argument("--kills", type=int, default=3)
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="raybench-"))
    delay = tmp / "delay"
    delay.write_text("0")
    with RayNodes(tmp) as nodes:
        nodes.add(num_cpus=4)
        os.environ.update({k: nodes.env()[k] for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")})
        import ray
        from ray._raylet import Config

        Config.initialize("")
        ray.init(address=nodes.address, namespace="pdserve", log_to_driver=False,
                 logging_level="WARNING")
        from pdserve.deploy import Deployment, PoolSpec, RayClusterSpec

        fake = {"cpus_per_rank": 0.1, "module": "tests.deploy.fake_worker"}
        spec = RayClusterSpec(
            model="/unused", name="bench", redis_url="redis://127.0.0.1:1/0", host="127.0.0.1",
            router=None, reconcile_period_s=1.0, restart_backoff_s=0.5,
            env={"PYTHONPATH": str(ROOT), "FAKE_READY_DELAY_FILE": str(delay)},
            prefill=PoolSpec("prefill", **fake), decode=PoolSpec("decode", replicas=2, **fake))
        d = Deployment.up(spec)
        try:
            idle = timed_status(d, a.calls)
            delay.write_text(str(a.load_seconds))
            d.scale("decode", 4, wait=False)
            scaling, phases = [], set()
            for _ in range(a.calls):
                t = time.perf_counter()
                st = d.status()
                scaling.append(time.perf_counter() - t)
                phases |= {p.phase for p in st.of("decode")}
            assert phases & {"placing", "starting"}, "the scale was over before it was measured"
            d.wait_ready(a.load_seconds * 4 + 60)
            delay.write_text("0")
            repairs = []
            for _ in range(a.kills):
                victim = d.status().of("decode")[0]
                os.kill(victim.pid, 9)
                t = time.perf_counter()
                while True:
                    st = d.status()
                    if st.converged and victim.name not in [x.name for x in st.processes]:
                        break
                    time.sleep(0.05)
                repairs.append(time.perf_counter() - t)
        finally:
            d.down()
            ray.shutdown()
    rows = [
        {"what": "status, idle (baseline)", "median_ms": statistics.median(idle) * 1e3,
         "max_ms": max(idle) * 1e3},
        {"what": f"status during a scale-up ({a.load_seconds:g} s loads)",
         "median_ms": statistics.median(scaling) * 1e3, "max_ms": max(scaling) * 1e3,
         "ratio": statistics.median(scaling) / statistics.median(idle)},
        {"what": "kill -9 of a worker -> replaced and ready",
         "median_ms": statistics.median(repairs) * 1e3, "max_ms": max(repairs) * 1e3},
    ]
    print_table(rows, ["what", "median_ms", "max_ms", "ratio"])
    out = ROOT / "bench" / "results" / "ray_control.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(a), "rows": rows,
                               "commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT,
                                                        capture_output=True, text=True)
                               .stdout.strip()}, indent=2))
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
