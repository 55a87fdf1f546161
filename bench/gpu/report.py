"""Merge the GPU sections' JSON parts into one file and print them as tables.

    python bench/gpu/report.py --parts DIR --out FILE.json

A section that never wrote its part (it crashed or timed out) shows as "missing".
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.common import print_table, write_json  # noqa: E402

TABLES = {
    "check": ["check", "dtype", "max_abs", "rel_l2", "ok", "error"],
    "decode": ["kv", "seqs", "ctx", "kv_MB", "splits", "ms", "TB_s", "of_peak", "of_copy",
               "error"],
    "gemm": ["M", "N=K", "bf16_ms", "bf16_TFLOPs", "fp8_ms", "fp8_TFLOPs", "fp8_quant_ms",
             "speedup", "fp8_rel_err", "fp8_error", "error"],
    "e2e": ["config", "status", "load_s", "b1_tok_s", "b32_tok_s", "error"],
}
TITLES = {
    "check": "(a) Triton kernels vs torch reference on CUDA (rel_l2 = |out-ref|/|ref|)",
    "decode": "(b) paged decode attention, bf16 q, 32 heads / 8 KV heads, head_dim 128, block 16",
    "gemm": "(c) FP8 (row-wise scaled_mm; fp8_quant_ms adds per-token quantisation) vs BF16",
    "e2e": "(d) end-to-end decode, ~0.85B random Llama, 128-token prompts, 128 new tokens",
}


def load_parts(parts: Path) -> dict:
    merged: dict = {}
    for name in ("check", "decode", "gemm"):
        f = parts / f"gpu_{name}.json"
        merged[name] = json.loads(f.read_text()) if f.exists() else {"error": "missing"}
    e2e = [json.loads(f.read_text()) for f in sorted(parts.glob("gpu_e2e_*.json"))]
    merged["e2e"] = {"rows": e2e} if e2e else {"error": "missing"}
    return merged


def show(merged: dict) -> None:
    for name, cols in TABLES.items():
        sec = merged[name]
        print(f"\n{TITLES[name]}")
        if sec.get("error"):
            print(f"  section error: {sec['error']}")
        rows = [_short(r) for r in sec.get("rows", [])]
        if rows:
            print_table(rows, [c for c in cols if any(c in r for r in rows)])


def _short(row: dict) -> dict:
    """Values as shown: errors cut to one line of 60 characters, n/a where a value is absent."""
    out = dict(row)
    for key in ("error", "fp8_error"):
        if key in out:
            out[key] = str(out[key]).splitlines()[0][:60]
    if out.get("status") == "n/a":
        out.setdefault("b1_tok_s", "n/a")
        out.setdefault("b32_tok_s", "n/a")
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    merged = load_parts(Path(args.parts))
    show(merged)
    path = write_json(args.out, {"gpu": merged})
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
