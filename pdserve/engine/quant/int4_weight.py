"""A 4-bit weight matrix as checkpoint loaders hand it to the W4A16 linear method.

Every 4-bit format this engine reads (GGUF Q4_0 / Q4_1 / Q4_K blocks, GPTQ and AWQ tensors, fp
weights quantised at load) is brought to one affine, group-wise form before it reaches a layer:

    w[n, k] = q[n, k] * scale[n, k // group_size] + offset[n, k // group_size]

with q an integer in [0, 15]. Q4_1 is exactly this (d, m); Q4_0 has offset = -8 * d; GPTQ and
AWQ have offset = -zero * scale; Q4_K's sub-block scales and mins become per-32 groups. Loaders
never dequantise to build it, so a checkpoint's 4-bit values reach the kernel unchanged.

Rows are output features, columns input features (the `nn.Linear` layout), so tensor-parallel
layers shard an `Int4Weight` like a dense weight: column-parallel layers take a run of rows,
row-parallel layers a run of columns that must start and end on group boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Int4Weight:
    qweight: torch.Tensor
    """uint8 [N, K], one 4-bit value in [0, 15] per element (unpacked)."""
    scale: torch.Tensor
    """float [N, K // group_size]: the step of each group."""
    offset: torch.Tensor
    """float [N, K // group_size]: the value q = 0 stands for in each group."""
    group_size: int
    """Input features per group (a power of two, at least 16)."""

    def __post_init__(self) -> None:
        n, k = self.qweight.shape
        g = self.group_size
        if g < 16 or g & (g - 1):
            raise ValueError(f"group_size must be a power of two >= 16, got {g}")
        if k % g:
            raise ValueError(f"{k} input features are not a whole number of groups of {g}")
        for name in ("scale", "offset"):
            shape = tuple(getattr(self, name).shape)
            if shape != (n, k // g):
                raise ValueError(f"{name} must be [{n}, {k // g}], got {list(shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qweight.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense [N, K] matrix (the reference every 4-bit kernel is tested against)."""
        n, k = self.qweight.shape
        q = self.qweight.to(torch.float32).view(n, k // self.group_size, self.group_size)
        w = q * self.scale.float().unsqueeze(-1) + self.offset.float().unsqueeze(-1)
        return w.view(n, k).to(dtype)

    def rows(self, start: int, length: int) -> Int4Weight:
        """Output rows [start, start + length) (column-parallel sharding, q/k/v splits)."""
        return Int4Weight(self.qweight.narrow(0, start, length),
                          self.scale.narrow(0, start, length),
                          self.offset.narrow(0, start, length), self.group_size)

    def columns(self, start: int, length: int) -> Int4Weight:
        """Input features [start, start + length), on group boundaries (row-parallel)."""
        g = self.group_size
        if start % g or length % g:
            raise ValueError(f"columns [{start}, {start + length}) split a group of {g} input "
                             "features: choose a tensor-parallel degree that divides the groups")
        return Int4Weight(self.qweight.narrow(1, start, length),
                          self.scale.narrow(1, start // g, length // g),
                          self.offset.narrow(1, start // g, length // g), g)

    def permute_rows(self, index: torch.Tensor) -> Int4Weight:
        """Rows reordered by `index` (e.g. undoing GGUF's rotary interleave of q/k)."""
        return Int4Weight(self.qweight.index_select(0, index), self.scale.index_select(0, index),
                          self.offset.index_select(0, index), self.group_size)
