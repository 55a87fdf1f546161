"""Triton paged attention over the head-major KV cache, for decode and for multi-token queries.

Cache of one layer: `[num_blocks, 2, num_kv_heads, block_size, head_dim]` (0 = K, 1 = V). A
request's keys are read through its row of the block table, one tile of `TILE_N` token positions
at a time; a tile may span several cache blocks (each position looks up its own block), so the
tile width is free of the block size. A uint8 cache holds packed FP8 rows (`head_dim` E4M3 bytes
and the row's fp32 scale, last dim `head_dim + 4`); its rows are dequantised as they are loaded.

GQA: a program owns one KV head and all the query heads of its group, so each K/V tile is read
once per group. Its rows are (query token, head in group) pairs, `G` rows per token.

- `paged_decode_attention`: one query per request. Grid (request, KV head, split); with several
  splits (flash-decoding) each program covers a slice of the context and writes a partial result
  with its log-sum-exp, and a second kernel merges the slices: long contexts in small batches
  then still fill the GPU.
- `paged_prefill_attention`: any number of query tokens per request (prefill chunks with a cached
  prefix, speculative verification, decode rows of a mixed batch). Grid (request, query tile,
  KV head); tiles past a request's query length return at once.

Causal rule (as in the torch reference): query j of a request with q_len new tokens and context
ctx sits at position ctx - q_len + j and sees keys at positions <= its own, and, with a sliding
window w, > its own - w. Softmax runs online in base 2 with fp32 accumulators.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.fp8 import KV_SCALE_BYTES, load_fp8_rows
from pdserve.kernels.runtime import check_tensors, is_interpreted, pow2, sm_count

_LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    # The CPU interpreter multiplies bf16 tiles as raw integers, so it computes in fp32 there.
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _attend_kv_range(q, acc, m_i, l_i, q_pos, kv_lo, kv_hi, window, qk_scale,
                     cache_ptr, table_ptr, kvh,
                     stride_cb, stride_ckv, stride_ch, stride_ct, BLOCK_M: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                     D_PAD: tl.constexpr, HAS_WINDOW: tl.constexpr, KV_FP8: tl.constexpr,
                     UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Fold keys [kv_lo, kv_hi) of one KV head into the running (acc, m_i, l_i) of q's rows."""
    offs_n = tl.arange(0, TILE_N)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    for start in range(kv_lo, kv_hi, TILE_N):
        k_pos = start + offs_n
        k_ok = k_pos < kv_hi
        block = tl.load(table_ptr + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        row = block * stride_cb + kvh * stride_ch + (k_pos % BLOCK_SIZE) * stride_ct
        ptrs = cache_ptr + row[:, None] + offs_d[None, :]
        kv_mask = k_ok[:, None] & d_ok[None, :]
        if KV_FP8:  # packed rows: E4M3 values, then the row's fp32 scale
            k = load_fp8_rows(ptrs, cache_ptr + row + HEAD_DIM, kv_mask, k_ok).to(q.dtype)
            v = load_fp8_rows(ptrs + stride_ckv, cache_ptr + stride_ckv + row + HEAD_DIM,
                              kv_mask, k_ok).to(q.dtype)
        else:
            k = tl.load(ptrs, mask=kv_mask, other=0.0).to(q.dtype)
            v = tl.load(ptrs + stride_ckv, mask=kv_mask, other=0.0).to(q.dtype)

        s = _dot(q, tl.trans(k), tl.zeros([BLOCK_M, TILE_N], tl.float32), UPCAST, PRECISION)
        s = s * qk_scale
        seen = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
        if HAS_WINDOW:
            seen = seen & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen nothing yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], UPCAST, PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _decode_kernel(q_ptr, cache_ptr, tables_ptr, seq_lens_ptr, qstart_ptr, out_ptr,
                   part_o_ptr, part_lse_ptr, qk_scale, window, num_splits,
                   stride_qt, stride_qh, stride_ot, stride_oh, stride_tb,
                   stride_cb, stride_ckv, stride_ch, stride_ct,
                   G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                   HAS_WINDOW: tl.constexpr, KV_FP8: tl.constexpr, SPLIT: tl.constexpr,
                   UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(seq_lens_ptr + seq).to(tl.int32)
    tok = tl.load(qstart_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    row_ok = rows < G
    heads = kvh * G + rows
    io_mask = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + tok * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=io_mask, other=0.0)
    q_pos = tl.where(row_ok, ctx - 1, -1)

    kv_lo = 0
    if HAS_WINDOW:
        kv_lo = tl.maximum(ctx - window, 0) // TILE_N * TILE_N
    tiles_per_split = tl.cdiv(tl.cdiv(ctx - kv_lo, TILE_N), num_splits)
    lo = kv_lo + split * tiles_per_split * TILE_N
    hi = tl.minimum(lo + tiles_per_split * TILE_N, ctx)

    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc, m_i, l_i = _attend_kv_range(
        q, acc, m_i, l_i, q_pos, lo, hi, window, qk_scale, cache_ptr,
        tables_ptr + seq * stride_tb, kvh, stride_cb, stride_ckv, stride_ch, stride_ct,
        BLOCK_M, BLOCK_SIZE, TILE_N, HEAD_DIM, D_PAD, HAS_WINDOW, KV_FP8, UPCAST,
        PRECISION)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # padding rows have l = 0
    if SPLIT:
        # Partials are [num_seqs, H, num_splits, HEAD_DIM] (fp32) and lse [num_seqs, H, splits].
        part_row = (seq * (tl.num_programs(1) * G) + heads) * num_splits + split
        tl.store(part_o_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=io_mask)
        # An empty slice (l = 0) gets lse = -inf, i.e. weight 0 in the merge.
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
        tl.store(part_lse_ptr + part_row, lse, mask=row_ok)
    else:
        tl.store(out_ptr + tok * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def _merge_splits_kernel(part_o_ptr, part_lse_ptr, qstart_ptr, out_ptr, num_splits,
                         stride_ot, stride_oh, S_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                         D_PAD: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tok = tl.load(qstart_ptr + seq)
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_ok = offs_s < num_splits
    d_ok = offs_d < HEAD_DIM
    base = (seq * tl.num_programs(1) + head) * num_splits
    lse = tl.load(part_lse_ptr + base + offs_s, mask=s_ok, other=float("-inf"))
    o = tl.load(part_o_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    # Every request has >= 1 key, so at least one split is finite.
    w = tl.math.exp2(lse - tl.max(lse, 0))
    out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=d_ok)


@triton.jit
def _prefill_kernel(q_ptr, cache_ptr, tables_ptr, seq_lens_ptr, qstart_ptr, out_ptr,
                    qk_scale, window,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_tb,
                    stride_cb, stride_ckv, stride_ch, stride_ct,
                    G: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                    D_PAD: tl.constexpr, HAS_WINDOW: tl.constexpr, KV_FP8: tl.constexpr,
                    UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(qstart_ptr + seq).to(tl.int32)
    q_len = tl.load(qstart_ptr + seq + 1).to(tl.int32) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    ctx = tl.load(seq_lens_ptr + seq).to(tl.int32)

    rows = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    tok = q_tile * BLOCK_Q + rows // G  # token index inside the request's query segment
    row_ok = (rows < BLOCK_Q * G) & (tok < q_len)
    heads = kvh * G + rows % G
    io_mask = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=io_mask, other=0.0)
    q_pos = tl.where(row_ok, ctx - q_len + tok, -1)

    first_pos = ctx - q_len + q_tile * BLOCK_Q
    hi = tl.minimum(first_pos + BLOCK_Q, ctx)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(first_pos - window + 1, 0) // TILE_N * TILE_N

    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc, m_i, l_i = _attend_kv_range(
        q, acc, m_i, l_i, q_pos, lo, hi, window, qk_scale, cache_ptr,
        tables_ptr + seq * stride_tb, kvh, stride_cb, stride_ckv, stride_ch, stride_ct,
        BLOCK_M, BLOCK_SIZE, TILE_N, HEAD_DIM, D_PAD, HAS_WINDOW, KV_FP8, UPCAST,
        PRECISION)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh
             + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=io_mask)


# ---------------------------------------------------------------------------------------------
# Launchers


def _check_inputs(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, query_start: torch.Tensor) -> None:
    check_tensors(_prefill_kernel, q=q, cache=cache, block_tables=block_tables,
                  seq_lens=seq_lens, query_start=query_start)
    if q.dim() != 3 or cache.dim() != 5 or cache.shape[1] != 2:
        raise ValueError(f"q must be [T, H, D] and cache [num_blocks, 2, KVH, block_size, D], "
                         f"got q {tuple(q.shape)} and cache {tuple(cache.shape)}")
    h, d, kvh = q.shape[1], q.shape[2], cache.shape[2]
    if cache.shape[4] != d + (KV_SCALE_BYTES if is_fp8_kv(cache) else 0) or h % kvh:
        raise ValueError(f"q {tuple(q.shape)} does not fit cache {tuple(cache.shape)} "
                         f"({cache.dtype}): head_dim must match (plus {KV_SCALE_BYTES} scale "
                         "bytes for a packed FP8 cache) and num_heads must be a multiple of "
                         "num_kv_heads")
    if q.stride(2) != 1 or cache.stride(4) != 1:
        raise ValueError("q and cache must be contiguous along head_dim")
    if block_tables.dim() != 2 or block_tables.stride(1) != 1:
        raise ValueError("block_tables must be a [num_seqs, max_blocks] row-contiguous tensor")
    n = block_tables.shape[0]
    if seq_lens.shape != (n,) or query_start.shape != (n + 1,):
        raise ValueError(f"seq_lens must be [{n}] and query_start [{n + 1}], got "
                         f"{tuple(seq_lens.shape)} and {tuple(query_start.shape)}")


def is_fp8_kv(cache: torch.Tensor) -> bool:
    """A uint8 cache holds packed FP8 rows (see pdserve.kernels.fp8.KV_SCALE_BYTES)."""
    return cache.dtype == torch.uint8


def _dot_flags(kernel: object, dtype: torch.dtype) -> dict:
    # fp32 models get exact fp32 products (no tf32), as the torch reference computes them.
    return {"UPCAST": is_interpreted(kernel) and dtype == torch.bfloat16,
            "PRECISION": "ieee" if dtype == torch.float32 else "tf32"}


def _default_tile_n(head_dim: int) -> int:
    return 64 if head_dim <= 128 else 32


def _cache_strides(cache: torch.Tensor) -> tuple[int, int, int, int]:
    return cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3)


def decode_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, tile_n: int,
                  device: torch.device) -> int:
    """How many context slices each (request, KV head) is cut into: enough programs for about
    two per multiprocessor, each slice at least 4 tiles long, a power of two (fewer compiles)."""
    programs = num_seqs * num_kv_heads
    sms = sm_count(device)
    if device.type != "cuda" or programs >= sms:
        return 1
    want = min(triton.cdiv(2 * sms, programs), triton.cdiv(max_seq_len, 4 * tile_n), 64)
    return 1 << max(0, want.bit_length() - 1)


def paged_decode_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, query_start: torch.Tensor, scale: float,
                           sliding_window: int | None = None, *, max_seq_len: int | None = None,
                           num_splits: int | None = None, tile_n: int | None = None
                           ) -> torch.Tensor:
    """Attention of exactly one query token per request (row query_start[i] of q, [T, H, D])
    over its cached context of seq_lens[i] tokens; returns [T, H, D] in q's dtype."""
    _check_inputs(q, cache, block_tables, seq_lens, query_start)
    num_seqs, (t, h, d), kvh = block_tables.shape[0], q.shape, cache.shape[2]
    g, d_pad = h // kvh, pow2(d, 16)
    tile_n = tile_n or _default_tile_n(d)
    if num_splits is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max()) if num_seqs else 0
        num_splits = decode_splits(num_seqs, kvh, max_seq_len, tile_n, q.device)
    out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    split = num_splits > 1
    part_o = part_lse = out  # placeholders: unused when not split
    if split:
        part_o = torch.empty((num_seqs, h, num_splits, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_seqs, h, num_splits), dtype=torch.float32, device=q.device)
    _decode_kernel[(num_seqs, kvh, num_splits)](
        q, cache, block_tables, seq_lens, query_start, out, part_o, part_lse,
        scale * _LOG2E, sliding_window or 0, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        *_cache_strides(cache),
        G=g, BLOCK_M=pow2(g, 16), BLOCK_SIZE=cache.shape[3], TILE_N=tile_n, HEAD_DIM=d,
        D_PAD=d_pad, HAS_WINDOW=sliding_window is not None, KV_FP8=is_fp8_kv(cache), SPLIT=split,
        **_dot_flags(_decode_kernel, q.dtype), num_warps=4)
    if split:
        _merge_splits_kernel[(num_seqs, h)](
            part_o, part_lse, query_start, out, num_splits, out.stride(0), out.stride(1),
            S_PAD=pow2(num_splits), HEAD_DIM=d, D_PAD=d_pad, num_warps=4)
    return out


def paged_prefill_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                            seq_lens: torch.Tensor, query_start: torch.Tensor, scale: float,
                            sliding_window: int | None = None, *,
                            max_query_len: int | None = None, block_m: int | None = None,
                            tile_n: int | None = None) -> torch.Tensor:
    """Causal attention of query segments [query_start[i], query_start[i+1]) of q ([T, H, D]),
    each the last tokens of a context of seq_lens[i] tokens; returns [T, H, D] in q's dtype."""
    _check_inputs(q, cache, block_tables, seq_lens, query_start)
    num_seqs, (t, h, d), kvh = block_tables.shape[0], q.shape, cache.shape[2]
    g = h // kvh
    if max_query_len is None:
        max_query_len = int((query_start[1:] - query_start[:-1]).max()) if num_seqs else 0
    out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    if num_seqs == 0 or max_query_len == 0:
        return out
    # Rows are (token, head-in-group) pairs: short verify segments get a small tile, and wide
    # heads a shorter one (the fp32 accumulator is block_m x head_dim registers).
    block_m = block_m or min(64 if d <= 128 else 32, pow2(max_query_len * g, 16))
    block_m = max(block_m, pow2(g))
    block_q = block_m // g
    _prefill_kernel[(num_seqs, triton.cdiv(max_query_len, block_q), kvh)](
        q, cache, block_tables, seq_lens, query_start, out,
        scale * _LOG2E, sliding_window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        *_cache_strides(cache),
        G=g, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_SIZE=cache.shape[3],
        TILE_N=tile_n or _default_tile_n(d), HEAD_DIM=d, D_PAD=pow2(d, 16),
        HAS_WINDOW=sliding_window is not None, KV_FP8=is_fp8_kv(cache),
        **_dot_flags(_prefill_kernel, q.dtype),
        num_warps=4)
    return out
