"""How fast a batch-1 decode step can read the default model's weights on this machine.

    .venv/bin/python bench/weight_read_bench.py [--threads 1] [--repeats 5]

The weight matrices of SmolLM2-135M-Instruct (30 layers of qkv 960x576, o 576x576, gate_up
3072x576, down 576x1536, and the 49152x576 LM head; fp32, 538 MB), each multiplied by one
activation row as a decode step does (`F.linear`, M = 1), against two baselines over the same
bytes in the same run: a plain read (`sum` of every matrix) and a tensor copy (bytes copied
per second, as `bench.common.memcpy_bandwidth` reports it: each byte is read and written).
Interleaved `--repeats` times; best and median. Writes bench/results/weight_read.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import print_table, write_json  # noqa: E402

LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LM_HEAD = (49152, 576)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--output", default="bench/results/weight_read.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    weights = [torch.randn(s) for s in LAYER * 30 + [LM_HEAD]]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    rows = {k: torch.randn(1, k) for k in (576, 1536)}
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    ways = {
        "F.linear, M=1 (decode GEMV)": lambda: [F.linear(rows[w.shape[1]], w) for w in weights],
        "plain read (sum)": lambda: [w.sum() for w in weights],
        "tensor copy (bytes copied)": lambda: dst.copy_(src),
    }
    seconds: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(a.repeats):
        for name, run in ways.items():
            t0 = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - t0)
    read_best = nbytes / min(seconds["plain read (sum)"])
    out = [{"what": k, "GB_s_best": nbytes / min(v) / 1e9,
            "GB_s_median": nbytes / statistics.median(v) / 1e9,
            "vs_plain_read": nbytes / min(v) / read_best} for k, v in seconds.items()]
    print(f"\nWeight bytes {nbytes / 1e6:.0f} MB, {a.threads} thread(s), "
          f"load average {os.getloadavg()[0]:.1f}")
    print_table(out, ["what", "GB_s_best", "GB_s_median", "vs_plain_read"])
    path = write_json(a.output, {"weight_bytes": nbytes, "rows": out,
                                 "load_average": os.getloadavg()[0]})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
