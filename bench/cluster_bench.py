"""Cluster latency: TTFT breakdown, and TTFT/TPOT of the cluster vs the single-process engine.

    python bench/cluster_bench.py [--prompt-tokens 2048] [--requests 6] [--max-tokens 32]
        [--model demo|default] [--kv-transports gloo [nixl ...]] [--skip-engine]

Both systems get the same prompts one at a time (latency, not throughput) and the same total
cores: the engine runs with all of this machine's threads, the cluster gives each of its two
workers half. TTFT parts come from the workers' counters: queueing and compute on the prefill
worker, and the exposed transfer (how long the decode worker still waited for KV after the
prefill finished) on the decode worker. The transfer's hidden share is 1 - exposed / transfer
time, where the transfer time is the sender's own per-request latency (first layer queued to
DONE sent). With several `--kv-transports`, one cluster per transport runs the same prompts
(`--kv-transport` of every worker), and the breakdown has a row per transport; `--model
default` is the real default model (SmolLM2-135M-Instruct) instead of the demo model, and
`--skip-engine` leaves out the single-process comparison.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import print_table, write_json  # noqa: E402
from pdserve.client import Client  # noqa: E402
from pdserve.default_model import ensure_default_model  # noqa: E402
from pdserve.demo_model import ensure_demo_model  # noqa: E402
from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.engine import LLMEngine  # noqa: E402
from pdserve.engine.sampling_params import SamplingParams  # noqa: E402
from pdserve.launcher import ClusterSpec, LocalCluster  # noqa: E402
from pdserve.proto import worker_pb, worker_pb_grpc  # noqa: E402


def prompts(n: int, length: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(4, 4000) for _ in range(length)] for _ in range(n)]


def engine_latency(model: Path, ps, max_tokens: int) -> list[tuple[float, float]]:
    torch.set_num_threads(os.cpu_count() or 1)
    engine = LLMEngine(EngineConfig(model=str(model), dtype="float32",
                                    enable_prefix_caching=False))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    out = []
    for i, p in enumerate([ps[0][:64]] + ps):  # first one warms up
        t0 = time.perf_counter()
        engine.add_request(f"r{i}", p, params)
        first = None
        while engine.has_unfinished():
            for o in engine.step():
                if first is None and o.new_token_ids:
                    first = time.perf_counter()
        end = time.perf_counter()
        if i:
            out.append((first - t0, (end - first) / (max_tokens - 1)))
    return out


def counters(cluster: LocalCluster, address: str) -> dict[str, float]:
    with cluster.security.channel(address) as ch:
        s = worker_pb_grpc.WorkerStub(ch).GetStats(worker_pb.StatsRequest(), timeout=10)
    return dict(s.counters)


def cluster_latency(model: Path | None, ps, max_tokens: int, logs: str, transport: str):
    threads = max(1, (os.cpu_count() or 2) // 2)
    spec = ClusterSpec(model=str(model or ""), port=0, threads_per_worker=threads, log_dir=logs,
                       worker_args=("--dtype", "float32", "--no-prefix-caching",
                                    "--kv-transport", transport))
    with LocalCluster(spec) as cluster, Client(cluster.address) as client:
        p_addr = cluster.workers("prefill")[0].info["address"]
        d_addr = cluster.workers("decode")[0].info["address"]
        client.generate(ps[0][:64], max_tokens=2, temperature=0.0)  # warm-up
        before = (counters(cluster, p_addr), counters(cluster, d_addr))
        lat = []
        for p in ps:
            t0 = time.perf_counter()
            first = None
            n = 0
            for chunk in client.stream(p, max_tokens=max_tokens, temperature=0.0,
                                       ignore_eos=True, timeout=600):
                if chunk.token_ids and first is None:
                    first = time.perf_counter()
                n += len(chunk.token_ids)
            end = time.perf_counter()
            assert n == max_tokens
            lat.append((first - t0, (end - first) / (max_tokens - 1)))
        after = (counters(cluster, p_addr), counters(cluster, d_addr))
    dp = {k: after[0].get(k, 0) - before[0].get(k, 0) for k in after[0]}
    dd = {k: after[1].get(k, 0) - before[1].get(k, 0) for k in after[1]}
    return lat, dp, dd


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--model", default="demo", choices=["demo", "default"])
    ap.add_argument("--kv-transports", nargs="+", default=["gloo"],
                    choices=["gloo", "nixl"])
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--output", default="bench/results/cluster.json")
    a = ap.parse_args()
    model = ensure_demo_model() if a.model == "demo" else None  # None: the default model
    ps = prompts(a.requests, a.prompt_tokens)
    runs = {}
    for t in a.kv_transports:
        with tempfile.TemporaryDirectory() as logs:
            runs[t] = cluster_latency(model, ps, a.max_tokens, logs, t)
    mean = statistics.mean
    rows, breakdowns = [], []
    if not a.skip_engine:
        e_lat = engine_latency(model or ensure_default_model(), ps, a.max_tokens)
        rows.append({"system": "single-process engine", "ttft_s": mean(x[0] for x in e_lat),
                     "tpot_ms": mean(x[1] for x in e_lat) * 1e3})
    for t, (c_lat, dp, dd) in runs.items():
        row = {"system": f"cluster 1P+1D ({t})", "ttft_s": mean(x[0] for x in c_lat),
               "tpot_ms": mean(x[1] for x in c_lat) * 1e3}
        rows.append(row)
        if not a.skip_engine:
            rows.append({"system": f"ratio cluster ({t}) / engine",
                         "ttft_s": row["ttft_s"] / rows[0]["ttft_s"],
                         "tpot_ms": row["tpot_ms"] / rows[0]["tpot_ms"]})
        breakdowns.append(breakdown(t, row["ttft_s"], dp, dd, a.requests))
    print(f"\nLatency, {a.model} model, {a.prompt_tokens}-token prompts, {a.max_tokens} new "
          f"tokens, one at a time, load average {os.getloadavg()[0]:.1f}")
    print_table(rows, ["system", "ttft_s", "tpot_ms"])
    print("\nCluster TTFT breakdown (means per request)")
    print_table(breakdowns, list(breakdowns[0]))
    path = write_json(a.output, {"model": a.model, "latency": rows, "breakdown": breakdowns})
    print(f"\nwrote {path}")


def breakdown(transport: str, ttft: float, dp: dict, dd: dict, n: int) -> dict:
    queue = dp.get("queue_s", 0) / n
    compute = dp.get("compute_s", 0) / n
    exposed = dd.get("kv_exposed_s", 0) / max(dd.get("kv_transfers", 0), 1)
    transfer = dp.get("kv_transfer_s", 0) / max(dp.get("kv_transfers_done", 0), 1)
    kv_bytes = dp.get("kv_bytes", 0) / n
    return {"transport": transport, "ttft_s": ttft, "prefill_queue_s": queue,
            "prefill_compute_s": compute, "exposed_transfer_s": exposed,
            "exposed_share_of_ttft": exposed / ttft, "router_and_rpc_s": ttft - queue - compute,
            "kv_MiB_per_request": kv_bytes / 2**20, "transfer_s": transfer,
            "transfer_GB_s": kv_bytes / transfer / 1e9 if transfer else None,
            "hidden_share": 1 - exposed / transfer if transfer else None}


if __name__ == "__main__":
    main()
