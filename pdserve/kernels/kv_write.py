"""Triton kernel that stores new tokens' K and V into the paged, head-major KV cache.

Token t goes to slot slot_mapping[t] = block * block_size + offset, i.e. to
cache[block, 0 (K) / 1 (V), :, offset, :]. A negative slot means "no cache slot" (padding
tokens) and is skipped. Values are cast to the cache's dtype on the way in; a uint8 cache holds
packed FP8 rows (E4M3 values and the row's fp32 scale, see `pdserve.kernels.fp8`), and each
(token, head) row is quantised with its own scale on the way in.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.fp8 import KV_SCALE_BYTES, store_fp8_rows
from pdserve.kernels.runtime import check_tensors, pow2


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, cache_ptr, slots_ptr, num_kv_heads, block_size,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_ckv, stride_ch, stride_ct,
                     HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, D_PAD: tl.constexpr,
                     KV_FP8: tl.constexpr):
    tok = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D_PAD)
    slot = tl.load(slots_ptr + tok)
    if slot < 0:
        return
    head_ok = heads < num_kv_heads
    mask = head_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    row = (slot // block_size) * stride_cb + (slot % block_size) * stride_ct + heads * stride_ch
    dst = cache_ptr + row[:, None] + offs_d[None, :]
    k = tl.load(k_ptr + tok * stride_kt + heads[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + tok * stride_vt + heads[:, None] * stride_vh + offs_d[None, :], mask=mask)
    if KV_FP8:
        store_fp8_rows(dst, cache_ptr + row + HEAD_DIM, k, mask, head_ok)
        store_fp8_rows(dst + stride_ckv, cache_ptr + stride_ckv + row + HEAD_DIM, v, mask,
                       head_ok)
    else:
        tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + stride_ckv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store k, v ([T, KVH, D]) into cache ([num_blocks, 2, KVH, block_size, D], or uint8 with
    a last dim of D + 4 for packed FP8) at slot_mapping ([T] int64). Mutates `cache`."""
    check_tensors(_kv_write_kernel, cache=cache, k=k, v=v, slot_mapping=slot_mapping)
    if cache.dim() != 5 or cache.shape[1] != 2:
        raise ValueError(f"cache must be [num_blocks, 2, KVH, block_size, D], got "
                         f"{tuple(cache.shape)}")
    t, kvh, d = k.shape
    fp8 = cache.dtype == torch.uint8
    want_d = cache.shape[4] - (KV_SCALE_BYTES if fp8 else 0)
    if v.shape != k.shape or (kvh, d) != (cache.shape[2], want_d):
        raise ValueError(f"k and v must both be [T, {cache.shape[2]}, {want_d}] for a "
                         f"{cache.dtype} cache of shape {tuple(cache.shape)}, got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if slot_mapping.shape != (t,):
        raise ValueError(f"slot_mapping must be [{t}], got {tuple(slot_mapping.shape)}")
    if k.stride(2) != 1 or v.stride(2) != 1 or cache.stride(4) != 1:
        raise ValueError("k, v and cache must be contiguous along head_dim")
    if t == 0:
        return
    d_pad = pow2(d, 16)
    block_h = min(pow2(kvh), max(1, 4096 // d_pad))
    _kv_write_kernel[(t, triton.cdiv(kvh, block_h))](
        k, v, cache, slot_mapping, kvh, cache.shape[3],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
        HEAD_DIM=d, BLOCK_H=block_h, D_PAD=d_pad, KV_FP8=fp8, num_warps=4)
