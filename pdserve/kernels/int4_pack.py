"""The nibble layout of the W4A16 Triton kernel, and its torch reference (pure torch).

`packed` uint8 [N, K / 2]: input features 2j and 2j + 1 of row n are the low and high nibble of
byte j. With `scale` and `offset` [N, K / group]:

    w[n, k] = q[n, k] * scale[n, k // group] + offset[n, k // group]

Kept apart from `w4a16` (which imports triton) so CPU code can pack and check without it.
"""

from __future__ import annotations

import torch


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] values in [0, 15] -> uint8 [N, K / 2] (even k low nibble, odd k high)."""
    if q.dim() != 2 or q.shape[1] % 2:
        raise ValueError(f"expected [N, K] with K even, got {list(q.shape)}")
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_nibbles`."""
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(packed.shape[0], -1)


def dequantize_packed(packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                      group_size: int) -> torch.Tensor:
    """The fp32 [N, K] matrix a packed weight stands for."""
    q = unpack_nibbles(packed).float()
    n, k = q.shape
    w = q.view(n, k // group_size, group_size) * scale.float().unsqueeze(-1)
    return (w + offset.float().unsqueeze(-1)).view(n, k)


def w4a16_matmul_ref(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                     offset: torch.Tensor, group_size: int) -> torch.Tensor:
    """Torch reference: x [M, K] @ dequantised w^T -> [M, N] in x.dtype (fp32 arithmetic)."""
    w = dequantize_packed(packed, scale, offset, group_size)
    return (x.float() @ w.t()).to(x.dtype)


def pack_block32(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] values in [0, 15] -> uint8 [ceil(N / 4), 2 K], the CPU kernel's layout
    (kernels/cpu/int4_linear.cpp): blocks of 32 inputs, a row's byte j of a block holding
    input j (low nibble) and input j + 16 (high nibble), GGUF's Q4_0 / Q4_1 order; rows in
    quads (a last partial quad padded with zero rows), block b of rows 4i..4i+3 one 64-byte
    unit with the rows' bytes interleaved: byte 4j + r of it is row 4i + r's byte j."""
    if q.dim() != 2 or q.shape[1] % 32:
        raise ValueError(f"expected [N, K] with K a multiple of 32, got {list(q.shape)}")
    n, k = q.shape
    q = torch.nn.functional.pad(q.to(torch.uint8), (0, 0, 0, -n % 4))
    b = q.reshape(-1, 4, k // 32, 2, 16)
    blocks = b[:, :, :, 0] | (b[:, :, :, 1] << 4)          # [quads, 4, K / 32, 16]
    return blocks.permute(0, 2, 3, 1).reshape(-1, 2 * k).contiguous()
