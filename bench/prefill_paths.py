"""Which path a fresh prompt's prefill takes on the CPU, and what it costs: the C++ paged
attention kernel (so the step runs the C++ decode loop, `engine/flat_decode.py`) against
SDPA over a gather (so the step runs the modules' forward), on the real default model.

    .venv/bin/python bench/prefill_paths.py [--lengths 32 128 256 512 1024] [--repeats 5]

`CpuPagedAttention` sends a prompt chunk to the kernel while query tokens x context stay
within `MAX_KERNEL_PAIRS`; `sdpa` sets it to 0 for its runs (decode rows still go to the
kernel), `kernel` leaves the default (and raises it past the longest prompt, so every length
is measured both ways). One engine, each repeat runs both modes in turn (order flipped every
round); medians; greedy first tokens compared. Writes bench/results/prefill_paths.json.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import alternated, print_table, write_json  # noqa: E402
from pdserve.engine import LLM, SamplingParams  # noqa: E402
from pdserve.engine.attention import cpu_backend  # noqa: E402

MODES = ("kernel", "sdpa")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[32, 128, 256, 512, 1024])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--output", default="bench/results/prefill_paths.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    longest = max(a.lengths)
    llm = LLM(None, dtype="float32", enable_prefix_caching=False,
              max_num_batched_tokens=max(1024, longest))
    params = [SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)]
    default_pairs = cpu_backend.MAX_KERNEL_PAIRS
    rng = random.Random(0)
    rows = []
    try:
        for length in a.lengths:
            prompt = [[rng.randrange(4, 4096) for _ in range(length)]]

            def run(mode: str, prompt=prompt) -> dict:
                cpu_backend.MAX_KERNEL_PAIRS = longest * longest if mode == "kernel" else 0
                t0 = time.perf_counter()
                out = llm.generate(prompt, params)
                return {"s": time.perf_counter() - t0, "token": out[0].token_ids[0]}

            run("kernel")  # warm: this length's first primitives and pages
            runs = alternated(MODES, a.repeats, run)
            ms = {m: statistics.median(r["s"] for r in runs[m]) * 1e3 for m in MODES}
            tokens = {m: {r["token"] for r in runs[m]} for m in MODES}
            rows.append({"tokens": length, "kernel_ms": ms["kernel"], "sdpa_ms": ms["sdpa"],
                         "kernel_vs_sdpa": ms["kernel"] / ms["sdpa"],
                         "default": "kernel" if length <= cpu_backend.MAX_KERNEL_QUERY
                         or length * length <= default_pairs else "sdpa",
                         "same_token": tokens["kernel"] == tokens["sdpa"]})
    finally:
        cpu_backend.MAX_KERNEL_PAIRS = default_pairs
    print(f"\nA fresh prompt's prefill (and its first token), medians of {a.repeats}, "
          f"{a.threads} threads; `default`: the path the engine takes")
    print_table(rows, ["tokens", "kernel_ms", "sdpa_ms", "kernel_vs_sdpa", "default",
                       "same_token"])
    path = write_json(a.output, {"repeats": a.repeats, "threads": a.threads,
                                 "max_kernel_pairs": default_pairs, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
