"""FP8 KV rows: E4M3 values and their float32 scale, packed into the same bytes.

A packed row is `head_dim + 4` uint8: bytes `[:head_dim]` are the E4M3 values of one token's
K (or V) for one head, bytes `[head_dim:]` its float32 scale (row amax / 448) in the machine's
byte order. Keeping the scale inside the row means whatever moves cache blocks (transfers,
tiers) moves the scales too, with no second tensor to keep in step. Pure torch, so every
attention backend can share it.
"""

from __future__ import annotations

import torch

from pdserve.engine.quant.fp8 import FP8_DTYPE, quantize_rows

SCALE_BYTES = 4  # one float32 per (token, head)
STORAGE_DTYPE = torch.uint8


def packed_dim(head_dim: int) -> int:
    """Bytes of one packed (token, head) row."""
    if head_dim <= 0 or head_dim % SCALE_BYTES:
        raise ValueError(f"FP8 KV cache needs head_dim to be a positive multiple of "
                         f"{SCALE_BYTES} (aligned scales), got {head_dim}")
    return head_dim + SCALE_BYTES


def is_packed_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == STORAGE_DTYPE


def pack_fp8(x: torch.Tensor) -> torch.Tensor:
    """[..., D] float -> [..., D + 4] uint8 (E4M3 values, then the row's float32 scale)."""
    lead, d = x.shape[:-1], x.shape[-1]
    q, scale = quantize_rows(x.reshape(-1, d))
    packed = torch.cat([q.view(STORAGE_DTYPE), scale.view(STORAGE_DTYPE)], dim=-1)
    return packed.view(*lead, d + SCALE_BYTES)


def unpack_fp8(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D + 4] uint8 -> [..., D] in `dtype` (values * scale, computed in float32)."""
    if packed.dtype != STORAGE_DTYPE:
        raise ValueError(f"packed FP8 KV must be uint8, got {packed.dtype}")
    d = packed.shape[-1] - SCALE_BYTES
    values = packed[..., :d].view(FP8_DTYPE)
    # A fresh contiguous copy is 4-byte aligned, which a float32 view requires.
    scale = packed[..., d:].contiguous().view(torch.float32)
    return values.float().mul_(scale).to(dtype)
