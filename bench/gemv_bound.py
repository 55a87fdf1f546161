"""Is the batch-1 step's weight GEMV bound by memory or by the core? The engine's own kernels
against a plain read of the same bytes, at 1 and 2 threads.

    .venv/bin/python bench/gemv_bound.py [--threads 1 2] [--repeats 15]

SmolLM2-135M-Instruct's decode weights as the default engine stores them: 30 layers of qkv
960x576, o 576x576, gate_up 3072x576 and down 576x1536 in the W4A16 layout
(`pdserve_layers::int4_linear`, 4-bit values with fp16 scale and offset per 32 inputs), and
the 49152x576 int8 LM head (`pdserve_layers::int8_linear`, an fp32 scale per 32). Each kernel
multiplies one activation row, as a batch-1 decode step does; the baseline is `sum` over a
buffer of the same size, in the same run. The weights are random bytes: the kernels' time
does not depend on the values. If the kernel's rate scales with threads while the read's
does not, the GEMV is bound by the core's vector work, not by the memory. Repeats are
interleaved; medians. Writes bench/results/gemv_bound.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import print_table, write_json  # noqa: E402
from pdserve.kernels.cpu import load_layer_ops  # noqa: E402

LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LM_HEAD = (49152, 576)
GROUP = 32


def int4_weights(layers: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(packed, scale, offset) per linear, in int4_linear's layout: [N / 4, 2 K] bytes."""
    out = []
    for _ in range(layers):
        for n, k in LAYER:
            out.append((torch.randint(0, 256, (n // 4, 2 * k), dtype=torch.uint8),
                        torch.rand(n, k // GROUP).half(), torch.rand(n, k // GROUP).half()))
    return out


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def time_ways(ways: dict[str, Callable[[], object]], threads: int,
              repeats: int) -> dict[str, float]:
    torch.set_num_threads(threads)
    seconds: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(repeats):
        for name, run in ways.items():
            t0 = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in seconds.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--output", default="bench/results/gemv_bound.json")
    a = ap.parse_args()
    ops = load_layer_ops()
    if ops is None:
        sys.exit("the CPU kernels did not build: nothing to measure")
    int4 = int4_weights(30)
    head_w = torch.randint(-127, 128, LM_HEAD, dtype=torch.int8)
    head_s = torch.rand(LM_HEAD[0], LM_HEAD[1] // GROUP)
    x = {k: torch.randn(1, k) for k in (576, 1536)}
    sizes = {"int4 linears (30 layers)": sum(nbytes(*w) for w in int4),
             "int8 LM head": nbytes(head_w, head_s)}
    reads = {name: torch.rand(size // 4) for name, size in sizes.items()}
    kernels = {
        "int4 linears (30 layers)": lambda: [ops.int4_linear(x[p.shape[1] // 2], p, s, o, GROUP)
                                             for p, s, o in int4],
        "int8 LM head": lambda: ops.int8_linear(x[576], head_w, head_s),
    }
    ways = {**{f"{n}: kernel": f for n, f in kernels.items()},
            **{f"{n}: plain read": (lambda t=t: t.sum()) for n, t in reads.items()}}
    for run in ways.values():  # warm: page in, build nothing inside the timing
        run()
    rows = []
    for threads in a.threads:
        medians = time_ways(ways, threads, a.repeats)
        for name, size in sizes.items():
            kernel, read = medians[f"{name}: kernel"], medians[f"{name}: plain read"]
            rows.append({"weights": name, "threads": threads, "MB": size / 1e6,
                         "kernel_ms": kernel * 1e3, "kernel_GB_s": size / kernel / 1e9,
                         "read_GB_s": size / read / 1e9, "kernel_vs_read": read / kernel})
    base = {r["weights"]: r for r in rows if r["threads"] == min(a.threads)}
    for r in rows:
        b = base[r["weights"]]
        r["kernel_scaling"] = r["kernel_GB_s"] / b["kernel_GB_s"]
        r["read_scaling"] = r["read_GB_s"] / b["read_GB_s"]
    print(f"\nBatch-1 GEMV of the default model's weights, load average "
          f"{os.getloadavg()[0]:.1f}, medians of {a.repeats}")
    print_table(rows, ["weights", "threads", "MB", "kernel_ms", "kernel_GB_s", "read_GB_s",
                       "kernel_vs_read", "kernel_scaling", "read_scaling"])
    path = write_json(a.output, {"repeats": a.repeats, "rows": rows,
                                 "load_average": os.getloadavg()[0]})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
