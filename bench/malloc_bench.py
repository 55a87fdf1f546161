"""What `host_malloc` buys on the CPU: the default engine on the real default model, the
batch-32 ragged workload (bench/engine_bench.py's), with glibc's freed activation pages
retained (`retain`, the default) against glibc's own thresholds (`system`).

    .venv/bin/python bench/malloc_bench.py [--repeats 5] [--threads 2] [--batch 32]

The setting is the process's, so each run is a fresh child process (the model loaded and
warmed first, then the workload timed once); the two modes alternate, and each pair's
time ratio (system / retain) is taken within the pair, since this machine's speed drifts
from minute to minute. A run's minor page faults (getrusage) say what the time pays for.
Greedy tokens are checked equal across every run. Writes bench/results/malloc.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import alternated, child_json, print_table, write_json  # noqa: E402
from pdserve.engine.host_malloc import HOST_MALLOC_MODES  # noqa: E402


def child(mode: str, threads: int, batch: int) -> None:
    import torch

    from bench.engine_bench import workload
    from pdserve.default_model import ensure_default_model
    from pdserve.engine import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(str(ensure_default_model()), dtype="float32", enable_prefix_caching=False,
              kv_cache_memory_gb=1.0, host_malloc=mode)
    prompts, max_new = workload(batch)
    llm.generate(prompts[:2], [SamplingParams(max_tokens=4, temperature=0.0)] * 2)  # warm
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_new]
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    print(json.dumps({"mode": mode, "seconds": dt, "tok_s": sum(max_new) / dt,
                      "minor_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                      - faults, "tokens": [o.token_ids for o in outs]}))


def run_child(mode: str, a: argparse.Namespace) -> dict:
    got = child_json([sys.executable, __file__, "--child", mode, "--threads", str(a.threads),
                      "--batch", str(a.batch)])
    print(f"{mode}: {got['seconds']:.2f} s, {got['minor_faults']} minor faults", flush=True)
    return got


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--child", choices=HOST_MALLOC_MODES, help=argparse.SUPPRESS)
    ap.add_argument("--output", default="bench/results/malloc.json")
    a = ap.parse_args()
    if a.child:
        return child(a.child, a.threads, a.batch)
    runs = alternated(HOST_MALLOC_MODES, a.repeats, lambda mode: run_child(mode, a))
    tokens = [r.pop("tokens") for rs in runs.values() for r in rs]
    assert all(t == tokens[0] for t in tokens), "greedy tokens differ between runs"
    ratios = [s["seconds"] / r["seconds"] for r, s in zip(runs["retain"], runs["system"],
                                                          strict=True)]
    rows = [{"mode": m, "tok_s": statistics.median(r["tok_s"] for r in rs),
             "seconds": statistics.median(r["seconds"] for r in rs),
             "minor_faults": statistics.median(r["minor_faults"] for r in rs),
             "speedup": statistics.median(ratios) if m == "retain" else 1.0}
            for m, rs in runs.items()]
    print(f"\nhost_malloc, default engine, batch {a.batch} ragged, {a.threads} threads, "
          f"medians of {a.repeats} (speedup: system/retain time, median of the pairs)")
    print_table(rows, ["mode", "tok_s", "seconds", "minor_faults", "speedup"])
    print(f"pair ratios: {', '.join(f'{r:.3f}' for r in ratios)}")
    path = write_json(a.output, {"threads": a.threads, "batch": a.batch, "repeats": a.repeats,
                                 "rows": rows, "pair_ratios": ratios, "runs": runs})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
