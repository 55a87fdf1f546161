"""W4A16 matmul: activations in 16 (or 32) bits times a 4-bit group-quantised weight (Triton).

Weight layout: `pdserve.kernels.int4_pack` (`pack_nibbles` of an `Int4Weight`'s values, and
`scale` / `offset` [N, K / group]; float16 on the GPU, the precision GGUF, GPTQ and AWQ store
them in).

The kernel never builds w. For one block of K inside one group it computes the integer part
and the offset part separately, `x @ q^T * scale + rowsum(x) * offset`, accumulating in fp32:
the products of x with the small integers q are exact, and the group's scale and offset are
applied once per output instead of once per weight. A block of K never straddles two groups
(BLOCK_K divides the group size).

`int4_pack.w4a16_matmul_ref` is the torch oracle (dequantise, multiply in fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.runtime import check_tensors, is_interpreted

BLOCK_M = 16  # tl.dot needs at least 16 rows; decode batches are padded up to it by masks
BLOCK_N = 64
MAX_BLOCK_K = 64


@triton.jit
def _w4a16_kernel(x_ptr, w_ptr, s_ptr, o_ptr, y_ptr, M, N, K,
                  stride_xm, stride_wn, stride_sn, stride_ym,
                  GROUP: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    shift = ((rk % 2) * 4).to(tl.uint8)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None], other=0.0)
        byte = tl.load(w_ptr + rn[None, :] * stride_wn + (kk[:, None] // 2), mask=n_ok[None, :],
                       other=0)
        q = ((byte >> shift[:, None]) & 0xF).to(tl.float32)  # [BLOCK_K, BLOCK_N], exact
        g = k0 // GROUP
        s = tl.load(s_ptr + rn * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)
        o = tl.load(o_ptr + rn * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)
        if UPCAST:  # the CPU interpreter multiplies bf16 tiles as raw integers
            xq = tl.dot(x.to(tl.float32), q)
        else:  # q is a small integer: exact in every 16-bit float
            xq = tl.dot(x, q.to(x.dtype), input_precision=PRECISION)
        xsum = tl.sum(x.to(tl.float32), axis=1)
        acc += xq * s[None, :] + xsum[:, None] * o[None, :]
    y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def w4a16_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                 offset: torch.Tensor, group_size: int) -> torch.Tensor:
    """Triton: x [M, K] (fp16/bf16/fp32) @ w^T -> [M, N] in x.dtype; see the module doc."""
    check_tensors(_w4a16_kernel, x=x, packed=packed, scale=scale, offset=offset)
    _check_shapes(x, packed, scale, offset, group_size)
    m, k = x.shape
    n = packed.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_k = min(group_size, MAX_BLOCK_K)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _w4a16_kernel[grid](x, packed, scale, offset, y, m, n, k, x.stride(0), packed.stride(0),
                        scale.stride(0), y.stride(0), GROUP=group_size,
                        UPCAST=is_interpreted(_w4a16_kernel) and x.dtype == torch.bfloat16,
                        # fp32 models get exact fp32 products (no TF32), like the reference
                        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=block_k, num_warps=4)
    return y


def _check_shapes(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                  offset: torch.Tensor, group_size: int) -> None:
    if x.dim() != 2 or x.stride(1) != 1 or x.dtype not in (torch.float16, torch.bfloat16,
                                                           torch.float32):
        raise ValueError(f"x must be a float [M, K] tensor contiguous along K, got {x.dtype} "
                         f"{list(x.shape)} strides {x.stride()}")
    k = x.shape[1]
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] * 2 != k:
        raise ValueError(f"packed must be uint8 [N, {k // 2}], got {packed.dtype} "
                         f"{list(packed.shape)}")
    if group_size < 16 or group_size & (group_size - 1) or k % group_size:
        raise ValueError(f"group_size must be a power of two >= 16 dividing K={k}, got "
                         f"{group_size}")
    want = (packed.shape[0], k // group_size)
    for name, t in (("scale", scale), ("offset", offset)):
        if tuple(t.shape) != want or t.stride(1) != 1 or t.stride(0) != scale.stride(0):
            raise ValueError(f"{name} must be a contiguous {list(want)} tensor, got "
                             f"{list(t.shape)}")
    if packed.stride(1) != 1:
        raise ValueError("packed must be contiguous along K")
