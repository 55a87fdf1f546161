"""FP8 (E4M3) quantisation: per-token dynamic activations (Triton + torch reference), per-output-
channel weights (torch, once at load), the scaled matmul that consumes both, and the Triton
helpers that read and write packed FP8 KV-cache rows (used by the attention and KV-write kernels).

Scheme: row r of x is stored as q[r] = round(x[r] / s[r]) in float8_e4m3fn with
s[r] = max(amax(|x[r]|) / 448, MIN_SCALE), so x[r] ~= q[r] * s[r]. 448 is E4M3's largest
finite value; MIN_SCALE keeps an all-zero row finite (its values are exact zeros). This is the
same function as `pdserve.engine.quant.fp8.quantize_rows` (whose scale is shaped [M, 1]).
The kernel divides with IEEE round-to-nearest (`div_rn`) and rounds to E4M3 nearest-even itself
before the cast, so it matches the reference bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.runtime import check_tensors, is_interpreted, pow2

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_SCALE = 1e-12
KV_SCALE_BYTES = 4
"""Packed FP8 KV rows (the layout of `pdserve.engine.quant.kv_fp8`): head_dim E4M3 bytes, then
the row's float32 scale, in one uint8 row of head_dim + 4 bytes."""

_FP8_MAX = tl.constexpr(FP8_MAX)
_MIN_SCALE = tl.constexpr(MIN_SCALE)


@triton.jit
def _round_to_e4m3_grid(y):
    """Round fp32 y (|y| <= 448) to the nearest E4M3 value, ties to even, staying in fp32.

    Adding then subtracting C = 1.5 * 2^(23 + log2 ulp) makes the fp32 adder round |y| at the
    E4M3 spacing ulp of |y|'s binade (2^-9 below 2^-6, the subnormals). The cast to fp8 after it
    is then exact on every backend; the CPU interpreter's own fp8 rounding is not.
    """
    bits = y.to(tl.int32, bitcast=True)
    a = tl.abs(y)
    binade = ((bits >> 23) & 0xFF) - 127
    ulp_exp = tl.maximum(binade, -6) - 3
    c = (((ulp_exp + 23 + 127) << 23) | 0x400000).to(tl.float32, bitcast=True)
    r = (a + c) - c
    return tl.where(bits < 0, -r, r)  # the sign bit, so -0.0 stays -0.0 as in torch


@triton.jit
def _row_scale(amax):
    return tl.maximum(tl.math.div_rn(amax, _FP8_MAX), _MIN_SCALE)


@triton.jit
def _to_e4m3(x, scale):
    """x / scale (fp32) as E4M3, saturated to +-448, rounded to nearest-even."""
    y = tl.clamp(tl.math.div_rn(x, scale), -_FP8_MAX, _FP8_MAX)
    return _round_to_e4m3_grid(y).to(tl.float8e4nv)


@triton.jit
def load_fp8_rows(ptrs, scale_ptrs, mask, row_mask):
    """Dequantise packed KV rows: [R, D_PAD] E4M3 bytes at ptrs (uint8), one fp32 scale per
    row at scale_ptrs (uint8 pointers to each row's scale bytes) -> fp32 [R, D_PAD]."""
    values = tl.load(ptrs, mask=mask, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    scale = tl.load(scale_ptrs.to(tl.pointer_type(tl.float32)), mask=row_mask, other=0.0)
    return values * scale[:, None]


@triton.jit
def store_fp8_rows(ptrs, scale_ptrs, x, mask, row_mask):
    """Quantise x [R, D_PAD] row by row and store it packed (see `load_fp8_rows`)."""
    x = tl.where(mask, x.to(tl.float32), 0.0)
    scale = _row_scale(tl.max(tl.abs(x), 1))
    tl.store(ptrs, _to_e4m3(x, scale[:, None]).to(tl.uint8, bitcast=True), mask=mask)
    tl.store(scale_ptrs.to(tl.pointer_type(tl.float32)), scale, mask=row_mask)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, num_cols, stride_xm, stride_qm,
                          BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    amax = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, num_cols, BLOCK_K):
        x = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=k0 + offs < num_cols, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    scale = _row_scale(tl.max(amax, 0))
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, num_cols, BLOCK_K):
        ok = k0 + offs < num_cols
        x = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * stride_qm + k0 + offs, _to_e4m3(x, scale), mask=ok)


def _check_2d(x: torch.Tensor, name: str) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"{name} must be a 2-D tensor contiguous along its last dim, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be floating point, got {x.dtype}")


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton: x [M, K] (fp32/bf16/fp16) -> (float8_e4m3fn [M, K], fp32 scale [M])."""
    check_tensors(_quantize_rows_kernel, x=x)
    _check_2d(x, "x")
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    _quantize_rows_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0),
                                BLOCK_K=min(pow2(k, 16), 4096), num_warps=4)
    return q, scale


def quantize_per_token_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of `quantize_per_token` (any device)."""
    _check_2d(x, "x")
    xf = x.float()
    scale = (xf.abs().amax(dim=1) / FP8_MAX).clamp_min(MIN_SCALE)
    q = (xf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token quantisation with the kernel where it can run (CUDA, or the interpreter), else
    with the reference: the two give identical results."""
    if x.is_cuda or is_interpreted(_quantize_rows_kernel):
        return quantize_per_token(x)
    return quantize_per_token_ref(x)


def quantize_weight_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (out_features x in_features) -> (float8_e4m3fn [N, K], fp32 scale [N]): one
    scale per output channel, w[n] ~= q[n] * scale[n]. Done once at load, in torch."""
    return quantize_per_token_ref(w)


def dequantize(q: torch.Tensor, scale: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [M, K] fp8 with per-row scale [M] -> [M, K] in `dtype`."""
    return (q.float() * scale.float()[:, None]).to(dtype)


def fp8_matmul(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor,
               w_scale: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(x_q * x_scale) @ (w_q * w_scale).T -> [M, N] in out_dtype, for x_q [M, K] and w_q [N, K].

    CUDA: one `torch._scaled_mm` with row-wise scales (Hopper; K and N multiples of 16).
    Elsewhere: dequantise and multiply in fp32 (the reference).
    """
    if x_q.is_cuda:
        return torch._scaled_mm(x_q, w_q.t(), scale_a=x_scale.float().reshape(-1, 1),
                                scale_b=w_scale.float().reshape(1, -1), out_dtype=out_dtype)
    return (dequantize(x_q, x_scale) @ dequantize(w_q, w_scale).t()).to(out_dtype)
