"""What `kv_cache_prefault` moves: a fresh engine's start time against its first requests'
prefill time, on the real default model, with the CPU KV cache mapped at start (`prefault`)
or as requests first write into it (`lazy`, the default).

    .venv/bin/python bench/kv_prefault_bench.py [--repeats 3] [--threads 2] [--requests 8]
        [--prompt-tokens 1024] [--kv-gb 1.0]

Each run is a fresh child process (page faults are the process's own). It builds the engine
(timed: `start_s`), then sends `--requests` distinct prompts one at a time with max_tokens=1,
prefix caching on as a server runs: every prompt lands in blocks no request used before, the
pages a lazy cache maps then. The two modes alternate, and each pair's ratio (lazy over
prefault prefill time) is taken within the pair, since this machine's speed drifts. Greedy
first tokens are checked equal across runs. Writes bench/results/kv_prefault.json.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import alternated, child_json, print_table, write_json  # noqa: E402

MODES = ("lazy", "prefault")


def child(mode: str, a: argparse.Namespace) -> None:
    import torch

    from pdserve.default_model import ensure_default_model
    from pdserve.engine import LLM, SamplingParams

    torch.set_num_threads(a.threads)
    model = str(ensure_default_model())
    t0 = time.perf_counter()
    llm = LLM(model, dtype="float32", kv_cache_memory_gb=a.kv_gb,
              kv_cache_prefault=mode == "prefault")
    start_s = time.perf_counter() - t0
    rng = random.Random(7)
    warm = [rng.randrange(4, 4096) for _ in range(16)]
    llm.generate([warm], [SamplingParams(max_tokens=2, temperature=0.0)])  # kernels, malloc
    params = SamplingParams(max_tokens=1, temperature=0.0)
    times, tokens = [], []
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(a.requests):
        prompt = [rng.randrange(4, 4096) for _ in range(a.prompt_tokens)]
        t1 = time.perf_counter()
        out = llm.generate([prompt], [params])[0]
        times.append(time.perf_counter() - t1)
        tokens.append(out.token_ids)
    print(json.dumps({"mode": mode, "start_s": start_s, "prefill_s": sum(times),
                      "per_request_ms": [t * 1e3 for t in times],
                      "minor_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                      - faults, "tokens": tokens}))


def run_child(mode: str, a: argparse.Namespace) -> dict:
    argv = [sys.executable, __file__, "--child", mode, "--threads", str(a.threads),
            "--requests", str(a.requests), "--prompt-tokens", str(a.prompt_tokens),
            "--kv-gb", str(a.kv_gb)]
    got = child_json(argv)
    print(f"{mode}: start {got['start_s']:.2f} s, prefills {got['prefill_s']:.2f} s, "
          f"{got['minor_faults']} minor faults", flush=True)
    return got


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--kv-gb", type=float, default=1.0)
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--output", default="bench/results/kv_prefault.json")
    a = ap.parse_args()
    if a.child:
        return child(a.child, a)
    runs = alternated(MODES, a.repeats, lambda mode: run_child(mode, a))
    tokens = [r.pop("tokens") for rs in runs.values() for r in rs]
    assert all(t == tokens[0] for t in tokens), "greedy tokens differ between runs"
    ratios = [lz["prefill_s"] / pf["prefill_s"]
              for lz, pf in zip(runs["lazy"], runs["prefault"], strict=True)]
    rows = [{"mode": m, "start_s": statistics.median(r["start_s"] for r in rs),
             "prefill_s": statistics.median(r["prefill_s"] for r in rs),
             "first_request_ms": statistics.median(r["per_request_ms"][0] for r in rs),
             "minor_faults": statistics.median(r["minor_faults"] for r in rs),
             "prefill_lazy_over_this": statistics.median(ratios) if m == "prefault" else 1.0}
            for m, rs in runs.items()]
    print(f"\nkv_cache_prefault, default model, {a.kv_gb} GiB cache, {a.requests} prompts of "
          f"{a.prompt_tokens} tokens one at a time, {a.threads} threads, medians of "
          f"{a.repeats}")
    print_table(rows, ["mode", "start_s", "prefill_s", "first_request_ms", "minor_faults",
                       "prefill_lazy_over_this"])
    print(f"pair ratios (lazy / prefault prefill time): {', '.join(f'{r:.3f}' for r in ratios)}")
    path = write_json(a.output, {"threads": a.threads, "requests": a.requests,
                                 "prompt_tokens": a.prompt_tokens, "kv_gb": a.kv_gb,
                                 "repeats": a.repeats, "rows": rows, "pair_ratios": ratios,
                                 "runs": runs})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
