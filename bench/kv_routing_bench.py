"""KV-aware routing vs round-robin on a prefix-heavy workload, same cluster shape.

    python bench/kv_routing_bench.py [--num-prompts 48] [--concurrency 4] [--repeats 3]

Two clusters of 2 prefill + 2 decode workers (demo model; each worker's KV cache is smaller
than all the shared prefixes need, so where a prefix lives matters), one routing with the
KV-aware policy and one round-robin, each driven by `pdserve bench --dataset prefix` (shared
system prompts, each followed by a short user part). Reports request throughput, mean and p99
TTFT and the share of prompt tokens served from cache, and the ratios. With `--repeats N` the
two policies alternate N times (so slow drift of a shared machine hits both alike); the table
shows every run's ratios and their median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import print_table, write_json  # noqa: E402
from pdserve.demo_model import ensure_demo_model  # noqa: E402
from pdserve.launcher import ClusterSpec, LocalCluster  # noqa: E402


def run(routing: str, a: argparse.Namespace, tmp: Path) -> dict:
    spec = ClusterSpec(model=str(ensure_demo_model()), port=0, num_prefill=2, num_decode=2,
                       threads_per_worker=1, log_dir=str(tmp / routing),
                       worker_args=("--dtype", "float32", "--num-gpu-blocks",
                                    str(a.blocks_per_worker)),
                       router_args=("--routing", routing))
    out = tmp / f"{routing}.json"
    with LocalCluster(spec) as cluster:
        subprocess.run(
            [sys.executable, "-m", "pdserve.loadgen", "--target", cluster.address,
             "--dataset", "prefix", "--num-prompts", str(a.num_prompts),
             "--concurrency", str(a.concurrency), "--num-prefixes", str(a.num_prefixes),
             "--prefix-len", str(a.prefix_len), "--input-len", str(a.input_len),
             "--output-len", str(a.output_len), "--seed", "0", "--output", str(out)],
            check=True, stdout=subprocess.DEVNULL)
    s = json.loads(out.read_text())["summary"]
    return {"routing": routing, "req_s": s["request_throughput"],
            "ttft_mean_ms": s["ttft_ms"]["mean"], "ttft_p99_ms": s["ttft_ms"]["p99"],
            "cached_share": s["cached_tokens"] / max(s["input_tokens"], 1),
            "failed": s["failed"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--num-prefixes", type=int, default=12)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--blocks-per-worker", type=int, default=640,
                    help="KV cache per worker: fewer blocks than all prefixes need, so where a "
                         "prefix lives matters")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--output", default="bench/results/kv_routing.json")
    a = ap.parse_args()
    rows, ratios = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.repeats):
            kv = run("kv", a, Path(tmp) / str(i))
            rr = run("round-robin", a, Path(tmp) / str(i))
            ratio = {"routing": f"run {i}: kv / round-robin", "req_s": kv["req_s"] / rr["req_s"],
                     "ttft_mean_ms": kv["ttft_mean_ms"] / rr["ttft_mean_ms"],
                     "ttft_p99_ms": kv["ttft_p99_ms"] / rr["ttft_p99_ms"]}
            rows += [kv, rr, ratio]
            ratios.append(ratio)
    rows.append({"routing": "median kv / round-robin",
                 **{k: statistics.median(r[k] for r in ratios)
                    for k in ("req_s", "ttft_mean_ms", "ttft_p99_ms")}})
    print(f"\nPrefix-heavy workload: {a.num_prompts} prompts, {a.num_prefixes} shared "
          f"{a.prefix_len}-token prefixes + {a.input_len} tokens, concurrency {a.concurrency}")
    print_table(rows, ["routing", "req_s", "ttft_mean_ms", "ttft_p99_ms", "cached_share",
                       "failed"])
    print(f"\nwrote {write_json(a.output, {'rows': rows})}")


if __name__ == "__main__":
    main()
