"""What starting a process costs: each entry point imported in a fresh interpreter (the
median wall time of --repeats), beside `import torch` in the same run as the baseline, and a
1 prefill + 1 decode cluster of the tiny demo checkpoint started and stopped (`LocalCluster`)
as the tests do it.

    python bench/startup_bench.py [--repeats 5] [--clusters 3] [--json out.json]

The ratio column is each import over `import torch`: the router, the launcher and the
`pdserve` commands load no torch, so theirs sit well below 1; a worker's (which runs the
model) is torch plus its own.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import print_table, write_json  # noqa: E402

ENTRY_POINTS = {
    "torch (baseline)": "import torch",
    "router": "import router.__main__",
    "launcher (pdserve up)": "import pdserve.launcher",
    "pdserve --help": "import runpy, sys; sys.argv = ['pdserve', '--help']\n"
                      "try:\n    runpy.run_module('pdserve', run_name='__main__')\n"
                      "except SystemExit:\n    pass",
    "ray supervisor": "import pdserve.deploy.process",
    "decode worker": "import decode_worker.__main__",
    "prefill worker": "import prefill_worker.__main__",
}


def time_import(code: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def time_clusters(n: int) -> tuple[float, float]:
    """Median seconds to start (every child READY) and to stop a 1P1D cluster."""
    from pdserve.demo_model import write_demo_model
    from pdserve.launcher import ClusterSpec, LocalCluster

    starts, stops = [], []
    with tempfile.TemporaryDirectory() as tmp:
        model = write_demo_model(Path(tmp) / "tiny", num_hidden_layers=2, hidden_size=64,
                                 intermediate_size=128, num_attention_heads=4,
                                 num_key_value_heads=2)
        spec = ClusterSpec(model=str(model), port=0, threads_per_worker=1,
                           worker_args=("--dtype", "float32", "--kv-cache-memory-gb", "0.25"),
                           log_dir=str(Path(tmp) / "logs"), env={"OMP_NUM_THREADS": "1"})
        for _ in range(n):
            t = time.perf_counter()
            cluster = LocalCluster(spec).start()
            starts.append(time.perf_counter() - t)
            t = time.perf_counter()
            cluster.stop()
            stops.append(time.perf_counter() - t)
    return statistics.median(starts), statistics.median(stops)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--clusters", type=int, default=3, help="cluster starts (0: none)")
    p.add_argument("--json", default="bench/results/startup.json")
    a = p.parse_args()
    rows = []
    base = None
    for name, code in ENTRY_POINTS.items():
        s = time_import(code, a.repeats)
        base = base or s
        rows.append({"process": name, "import_s": round(s, 3), "vs_torch": round(s / base, 2)})
    print_table(rows, ["process", "import_s", "vs_torch"])
    result = {"imports": rows}
    if a.clusters:
        start, stop = time_clusters(a.clusters)
        cl = [{"cluster": "1P1D tiny", "start_s": round(start, 2), "stop_s": round(stop, 2)}]
        print_table(cl, ["cluster", "start_s", "stop_s"])
        result["cluster"] = cl[0]
    write_json(a.json, result)


if __name__ == "__main__":
    main()
