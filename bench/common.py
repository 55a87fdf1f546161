"""Shared bench helpers: timing, memory bandwidth, tables and JSON output."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch


def memcpy_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Best-of-N bytes/s of a large tensor copy (read + write counted once, like STREAM copy
    reports it per direction: we return bytes copied per second)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def machine() -> dict:
    return {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(), "torch": torch.__version__, **cpu_model()}


def cpu_model() -> dict:
    """The CPU's name and the vector/matrix extensions that change which kernels run (a
    figure from an AVX-512/AMX machine does not carry over to an AVX2 one)."""
    name, flags = platform.processor(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8")
    return {"cpu": name, "cpu_flags": [f for f in wanted if f in flags],
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()}


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths, strict=True)))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return "" if v is None else str(v)


def write_json(path: str | Path, payload: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2))
    return path


def child_json(argv: list[str], timeout_s: float = 1800) -> dict:
    """Run a bench's child process (a fresh one per run: what it measures is the process's
    own) and parse the JSON its last line of output holds."""
    out = subprocess.run(argv, check=True, capture_output=True, text=True, timeout=timeout_s)
    return json.loads(out.stdout.strip().splitlines()[-1])


def alternated(modes: tuple[str, ...], repeats: int,
               run: Callable[[str], dict]) -> dict[str, list[dict]]:
    """`repeats` runs of each mode, the order flipped every round, so the machine's drift
    between minutes hits every mode alike: {mode: [run, ...]}."""
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for i in range(repeats):
        for mode in modes if i % 2 == 0 else modes[::-1]:
            runs[mode].append(run(mode))
    return runs
