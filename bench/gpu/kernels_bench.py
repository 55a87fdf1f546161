"""GPU kernel checks and timings, one section per process (a CUDA fault stays in its section).

    python bench/gpu/kernels_bench.py {check,decode,gemm} --out DIR

- check:  each Triton kernel against its torch reference on CUDA at realistic shapes (errors).
- decode: paged decode attention time, KV bytes read / time, as a fraction of the HBM peak and
          of the measured device-to-device copy bandwidth.
- gemm:   FP8 (torch._scaled_mm, row-wise scales) vs BF16 GEMM at M = 1, 16, 256, 4096.

Each section writes DIR/gpu_<section>.json ({"rows": [...], "error": ...}); report.py merges them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pdserve.engine.attention.torch_ref import TorchAttention  # noqa: E402
from tests.kernels.cases import make_case  # noqa: E402

HBM_PEAK = 4.8e12  # H200 datasheet, bytes/s
DEV = torch.device("cuda")


def bench_ms(fn, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of fn() by CUDA events (triton's do_bench when present)."""
    try:
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    except (ImportError, TypeError):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(20):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        return sorted(times)[len(times) // 2]


# ---------------------------------------------------------------------------------------------
# (a) correctness


ATTN_CASES = [  # name, q_lens, ctx_lens, heads, kv_heads, head_dim, window
    ("decode-16seq", [1] * 16, [1, 17, 300, 4096] * 4, 32, 8, 128, None),
    ("decode-window", [1] * 4, [5, 900, 2000, 4097], 32, 8, 128, 1024),
    ("decode-g7-d64", [1] * 3, [33, 513, 2049], 28, 4, 64, None),
    ("prefill-ragged-prefix", [512, 1, 77, 300], [512, 2000, 1077, 4300], 32, 8, 128, None),
    ("verify-5tok", [5] * 6, [6, 100, 777, 1500, 3000, 4100], 32, 8, 128, None),
    ("prefill-window", [700, 64], [700, 3000], 32, 8, 128, 256),
    ("prefill-d256-mqa", [100, 3], [300, 50], 8, 1, 256, None),
]


def check_attention(dtype: torch.dtype) -> list[dict]:
    from pdserve.kernels.paged_attention import paged_decode_attention, paged_prefill_attention

    rows = []
    for name, q_lens, ctx, h, kvh, d, window in ATTN_CASES:
        case = make_case(q_lens, ctx, heads=h, kv_heads=kvh, head_dim=d, block_size=16,
                         dtype=dtype, seed=len(rows), device=DEV)
        m = case.meta
        args = (case.q, case.cache, m.block_tables, m.seq_lens_t, m.query_start_t, case.scale,
                window)
        if m.max_query_len == 1:
            out = paged_decode_attention(*args, max_seq_len=m.max_seq_len)
        else:
            out = paged_prefill_attention(*args, max_query_len=m.max_query_len)
        ref = TorchAttention().attend(case.q.float(), case.cache.float(), m, case.scale, window)
        diff = (out.float() - ref).abs()
        rel = (diff.norm() / ref.norm()).item()
        limit = 1e-4 if dtype == torch.float32 else 1e-2
        ok = bool(torch.isfinite(out).all()) and rel < limit
        rows.append({"check": f"attn {name}", "dtype": str(dtype)[6:], "max_abs": diff.max().item(),
                     "rel_l2": rel, "ok": ok})
    return rows


KV_WRITE_CASE = ([300, 1, 57], [300, 1000, 2000])  # q_lens, ctx_lens
FP8_SHAPE = (4096, 8192)


def check_kv_write(dtype: torch.dtype) -> dict:
    from pdserve.kernels.kv_write import write_kv

    case = make_case(*KV_WRITE_CASE, heads=32, kv_heads=8, head_dim=128, block_size=16,
                     dtype=dtype, device=DEV)
    ours, ref = case.cache.clone(), case.cache.clone()
    write_kv(ours, case.k, case.v, case.meta.slot_mapping)
    TorchAttention().write_kv(ref, case.k, case.v, case.meta)
    same = torch.equal(ours, ref)
    return {"check": "kv_write", "dtype": str(dtype)[6:], "max_abs": 0.0 if same else
            (ours.float() - ref.float()).abs().max().item(), "rel_l2": 0.0, "ok": same}


def check_fp8(dtype: torch.dtype) -> dict:
    from pdserve.kernels.fp8 import quantize_per_token, quantize_per_token_ref

    m, k = FP8_SHAPE
    x = (torch.randn(m, k, device=DEV) * torch.rand(m, 1, device=DEV) * 10).to(dtype)
    q, s = quantize_per_token(x)
    qr, sr = quantize_per_token_ref(x)
    codes = (q.view(torch.uint8) != qr.view(torch.uint8)).sum().item()
    return {"check": "fp8 per-token quant", "dtype": str(dtype)[6:],
            "max_abs": (q.float() - qr.float()).abs().max().item(),
            "rel_l2": (s - sr).abs().max().item(), "ok": codes == 0 and torch.equal(s, sr),
            "mismatched_codes": codes}


FP8_KV_CASES = [("decode", [1] * 8, [1, 300, 2049, 4096] * 2),
                ("prefill", [512, 1, 77], [512, 2000, 1077])]


def check_fp8_kv(dtype: torch.dtype) -> list[dict]:
    """Packed FP8 KV cache: write bit-exact and attention vs the reference's dequantisation."""
    from pdserve.kernels.kv_write import write_kv
    from pdserve.kernels.paged_attention import paged_decode_attention, paged_prefill_attention
    from tests.kernels.cases import with_packed_fp8_cache

    rows = []
    for name, q_lens, ctx in FP8_KV_CASES:
        case = make_case(q_lens, ctx, heads=32, kv_heads=8, head_dim=128, block_size=16,
                         dtype=dtype, seed=7, device=DEV)
        case = with_packed_fp8_cache(case, q_lens, ctx, seed=7)
        m = case.meta
        args = (case.q, case.cache, m.block_tables, m.seq_lens_t, m.query_start_t, case.scale)
        fn = paged_decode_attention if m.max_query_len == 1 else paged_prefill_attention
        out = fn(*args)
        ref = TorchAttention().attend(case.q.float(), case.cache, m, case.scale, None)
        diff = (out.float() - ref).abs()
        rel = (diff.norm() / ref.norm()).item()
        limit = 1e-4 if dtype == torch.float32 else 1e-2
        rows.append({"check": f"fp8-kv attn {name}", "dtype": str(dtype)[6:],
                     "max_abs": diff.max().item(), "rel_l2": rel,
                     "ok": bool(torch.isfinite(out).all()) and rel < limit})
        ours, theirs = case.cache.clone(), case.cache.clone()
        write_kv(ours, case.k, case.v, m.slot_mapping)
        TorchAttention().write_kv(theirs, case.k, case.v, m)
        rows.append({"check": f"fp8-kv write {name}", "dtype": str(dtype)[6:],
                     "max_abs": float((ours != theirs).sum().item()), "rel_l2": 0.0,
                     "ok": torch.equal(ours, theirs)})
    return rows


def section_check() -> list[dict]:
    rows = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for fn in (check_attention, check_kv_write, check_fp8, check_fp8_kv):
            try:
                got = fn(dtype)
                rows.extend(got if isinstance(got, list) else [got])
            except Exception as e:  # one failing check must not hide the others
                rows.append({"check": fn.__name__, "dtype": str(dtype)[6:], "ok": False,
                             "error": f"{type(e).__name__}: {e}"})
                traceback.print_exc()
    return rows


# ---------------------------------------------------------------------------------------------
# (b) decode attention bandwidth


DECODE_SHAPES = [(1, 131072), (8, 16384), (32, 8192), (64, 4096), (256, 2048)]
DECODE_FP8_SHAPES = [(8, 16384, True), (256, 2048, True)]  # packed FP8 KV (D + 4 bytes a row)


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (the practical HBM ceiling)."""
    src = torch.empty(2**30, dtype=torch.uint8, device=DEV).random_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), warmup=5, rep=50)
    return 2 * src.numel() / (ms * 1e-3)


def _random_cache(num_blocks: int, kvh: int, bs: int, d: int, fp8: bool) -> torch.Tensor:
    shape = (num_blocks, 2, kvh, bs, d)
    if not fp8:
        return torch.randn(shape, device=DEV, dtype=torch.bfloat16)
    values = torch.randn(shape, device=DEV).to(torch.float8_e4m3fn).view(torch.uint8)
    scales = torch.full((*shape[:4], 1), 0.01, device=DEV).view(torch.uint8)  # 4 bytes a row
    return torch.cat([values, scales], dim=-1)


def decode_row(num_seqs: int, ctx: int, copy_bw: float, fp8: bool = False) -> dict:
    from pdserve.kernels.paged_attention import (
        _default_tile_n,
        decode_splits,
        paged_decode_attention,
    )

    h, kvh, d, bs = 32, 8, 128, 16
    nblk = num_seqs * ctx // bs
    cache = _random_cache(nblk + 1, kvh, bs, d, fp8)
    tables = (torch.randperm(nblk, device=DEV) + 1).view(num_seqs, ctx // bs)
    lens = torch.full((num_seqs,), ctx, dtype=torch.int64, device=DEV)
    qs = torch.arange(num_seqs + 1, dtype=torch.int64, device=DEV)
    q = torch.randn(num_seqs, h, d, device=DEV, dtype=torch.bfloat16)

    def run():
        paged_decode_attention(q, cache, tables, lens, qs, d ** -0.5, max_seq_len=ctx)

    ms = bench_ms(run)
    kv_bytes = num_seqs * ctx * kvh * cache.shape[-1] * 2 * cache.element_size()
    bw = kv_bytes / (ms * 1e-3)
    return {"kv": "fp8" if fp8 else "bf16", "seqs": num_seqs, "ctx": ctx,
            "kv_MB": kv_bytes / 1e6, "ms": ms,
            "splits": decode_splits(num_seqs, kvh, ctx, _default_tile_n(d), DEV),
            "TB_s": bw / 1e12, "of_peak": bw / HBM_PEAK, "of_copy": bw / copy_bw}


def section_decode() -> list[dict]:
    copy_bw = copy_bandwidth()
    print(f"device copy bandwidth: {copy_bw / 1e12:.2f} TB/s (read + write)")
    rows = []
    for num_seqs, ctx, fp8 in [(n, c, False) for n, c in DECODE_SHAPES] + DECODE_FP8_SHAPES:
        try:
            rows.append(decode_row(num_seqs, ctx, copy_bw, fp8))
        except Exception as e:
            rows.append({"kv": "fp8" if fp8 else "bf16", "seqs": num_seqs, "ctx": ctx,
                         "error": f"{type(e).__name__}: {e}"})
            traceback.print_exc()
        torch.cuda.empty_cache()
    rows.append({"seqs": "copy", "TB_s": copy_bw / 1e12, "of_peak": copy_bw / HBM_PEAK})
    return rows


# ---------------------------------------------------------------------------------------------
# (c) FP8 vs BF16 GEMM


def gemm_row(m: int, nk: int) -> dict:
    from pdserve.kernels.fp8 import fp8_matmul, quantize_per_token, quantize_weight_per_channel

    x = torch.randn(m, nk, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(nk, nk, device=DEV, dtype=torch.bfloat16)
    flops = 2 * m * nk * nk
    row = {"M": m, "N=K": nk}
    ms_bf16 = bench_ms(lambda: torch.nn.functional.linear(x, w))
    row.update(bf16_ms=ms_bf16, bf16_TFLOPs=flops / ms_bf16 / 1e9)
    wq, ws = quantize_weight_per_channel(w)
    xq, xs = quantize_per_token(x)
    try:
        ms_mm = bench_ms(lambda: fp8_matmul(xq, xs, wq, ws))
        ms_all = bench_ms(lambda: fp8_matmul(*quantize_per_token(x), wq, ws))
        ref = x.float() @ w.float().t()
        err = (fp8_matmul(xq, xs, wq, ws).float() - ref).norm() / ref.norm()
        row.update(fp8_ms=ms_mm, fp8_TFLOPs=flops / ms_mm / 1e9, fp8_quant_ms=ms_all,
                   speedup=ms_bf16 / ms_all, fp8_rel_err=err.item())
    except Exception as e:  # e.g. _scaled_mm refusing this shape
        row["fp8_error"] = f"{type(e).__name__}: {e}"
    return row


def section_gemm() -> list[dict]:
    rows = []
    for nk in (4096, 8192):
        for m in (1, 16, 256, 4096):
            try:
                rows.append(gemm_row(m, nk))
            except Exception as e:
                rows.append({"M": m, "N=K": nk, "error": f"{type(e).__name__}: {e}"})
                traceback.print_exc()
    return rows


SECTIONS = {"check": section_check, "decode": section_decode, "gemm": section_gemm}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("section", choices=sorted(SECTIONS))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    payload: dict = {"section": args.section}
    try:
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA is not available")
        payload["device"] = torch.cuda.get_device_name()
        payload["rows"] = SECTIONS[args.section]()
    except Exception as e:
        payload["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    payload["seconds"] = time.perf_counter() - t0
    (out / f"gpu_{args.section}.json").write_text(json.dumps(payload, indent=2))
    print(f"[{args.section}] done in {payload['seconds']:.1f}s"
          + (f" with error: {payload['error']}" if "error" in payload else ""))
    return 0 if "error" not in payload else 1


if __name__ == "__main__":
    sys.exit(main())
