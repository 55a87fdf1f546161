"""Tensor parallelism on this machine: prefill throughput at TP=1 vs TP=2, and the KV bytes a
prefill moves to the decode worker with and without re-sharding.

    python bench/tp_bench.py [--prompt-tokens 1024] [--prompts 4]

Prefill throughput: `LLM(tensor_parallel_size=N)` prefilling the same prompts (max_tokens=1),
with the same total thread budget (TP=1: all cores in one process; TP=2: one per rank).
Bytes moved: the prefill worker's `kv_bytes` counter for one request through clusters whose
prefill/decode TP degrees are (1,1), (2,1), (1,2) and (2,2) — re-sharding must not move more
bytes, only split them differently.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import print_table, write_json  # noqa: E402
from pdserve.client import Client  # noqa: E402
from pdserve.demo_model import ensure_demo_model  # noqa: E402
from pdserve.engine import LLM, SamplingParams  # noqa: E402
from pdserve.launcher import ClusterSpec, LocalCluster  # noqa: E402
from tests.helpers.cluster import worker_stats  # noqa: E402


def prompts(n: int, length: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(4, 4000) for _ in range(length)] for _ in range(n)]


def prefill_tps(model: str, tp: int, ps: list[list[int]]) -> float:
    cores = os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // tp))
    params = SamplingParams(max_tokens=1, temperature=0.0)
    with LLM(model, dtype="float32", tensor_parallel_size=tp, enable_prefix_caching=False,
             max_num_batched_tokens=2048) as llm:
        llm.generate(ps[:1], params)  # warm-up
        t0 = time.perf_counter()
        llm.generate(ps, params)
        return sum(len(p) for p in ps) / (time.perf_counter() - t0)


def kv_bytes(model: str, prefill_tp: int, decode_tp: int, prompt: list[int], logs: str) -> int:
    spec = ClusterSpec(model=model, port=0, prefill_tp=prefill_tp, decode_tp=decode_tp,
                       threads_per_worker=1, log_dir=logs,
                       worker_args=("--dtype", "float32", "--no-prefix-caching"))
    with LocalCluster(spec) as cluster, Client(cluster.address) as client:
        client.generate(prompt, max_tokens=2, temperature=0.0, timeout=300)
        address = cluster.workers("prefill")[0].info["address"]
        time.sleep(0.5)  # the transfer's completion is counted asynchronously
        return int(worker_stats(address).counters.get("kv_bytes", 0))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--output", default="bench/results/tp.json")
    a = ap.parse_args()
    model = str(ensure_demo_model())
    ps = prompts(a.prompts, a.prompt_tokens)
    tps = {tp: prefill_tps(model, tp, ps) for tp in (1, 2)}
    rows = [{"tp": tp, "prefill_tok_s": v, "vs_tp1": v / tps[1]} for tp, v in tps.items()]
    print(f"\nPrefill throughput, {a.prompts} x {a.prompt_tokens}-token prompts, "
          f"{os.cpu_count()} cores in total")
    print_table(rows, ["tp", "prefill_tok_s", "vs_tp1"])
    moved = []
    with tempfile.TemporaryDirectory() as logs:
        for ptp, dtp in ((1, 1), (2, 1), (1, 2), (2, 2)):
            moved.append({"prefill_tp": ptp, "decode_tp": dtp,
                          "kv_bytes": kv_bytes(model, ptp, dtp, ps[0], logs)})
    base = moved[0]["kv_bytes"] or 1
    for m in moved:
        m["vs_no_resharding"] = m["kv_bytes"] / base
    print(f"\nKV bytes moved for one {a.prompt_tokens}-token prompt")
    print_table(moved, ["prefill_tp", "decode_tp", "kv_bytes", "vs_no_resharding"])
    print(f"\nwrote {write_json(a.output, {'prefill': rows, 'kv_bytes': moved})}")


if __name__ == "__main__":
    main()
