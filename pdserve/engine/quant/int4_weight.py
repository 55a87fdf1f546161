"""A 4-bit weight matrix as checkpoint loaders hand it to the W4A16 linear method.

Every 4-bit format this engine reads (GGUF Q4_0 / Q4_1 / Q4_K blocks, GPTQ and AWQ tensors, fp
weights quantised at load) is brought to one affine, group-wise form before it reaches a layer:

    w[n, k] = q[n, k] * scale[n, k // group_size] + offset[n, k // group_size]

with q an integer in [0, 15]. Q4_1 is exactly this (d, m); Q4_0 has offset = -8 * d; GPTQ and
AWQ have offset = -zero * scale; Q4_K's sub-block scales and mins become per-32 groups. Loaders
never dequantise to build it, so a checkpoint's 4-bit values reach the kernel unchanged.

Rows are output features, columns input features (the `nn.Linear` layout), so tensor-parallel
layers shard an `Int4Weight` like a dense weight (`narrow`, as on a tensor): column-parallel
layers take a run of rows, row-parallel layers a run of columns that must start and end on group
boundaries.

GPTQ's act-order (`desc_act`) quantises input features in a permuted order, so a group's members
are scattered over the row. Sorting the columns by group makes the groups contiguous again;
`column_order` records which input feature each stored column is (`x[:, column_order]` is what
the stored matrix multiplies). Such a weight cannot be split by input feature.
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
    column_order: torch.Tensor | None = None
    """int64 [K]: the input feature of each stored column (act-order); None: column j is
    feature j."""

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
        order = self.column_order
        if order is not None and (order.dim() != 1 or order.numel() != k):
            raise ValueError(f"column_order must be [{k}], got {list(order.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qweight.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense [N, K] matrix (the reference every 4-bit kernel is tested against)."""
        n, k = self.qweight.shape
        q = self.qweight.to(torch.float32).view(n, k // self.group_size, self.group_size)
        w = (q * self.scale.float().unsqueeze(-1) + self.offset.float().unsqueeze(-1)).view(n, k)
        if self.column_order is not None:
            w = torch.empty_like(w).index_copy_(1, self.column_order, w)
        return w.to(dtype)

    def narrow(self, dim: int, start: int, length: int) -> Int4Weight:
        """Like `Tensor.narrow`: dim 0 takes output rows, dim 1 input features."""
        if dim == 0:
            return self.rows(start, length)
        if dim == 1:
            return self.columns(start, length)
        raise ValueError(f"an Int4Weight has dims 0 (rows) and 1 (columns), not {dim}")

    def rows(self, start: int, length: int) -> Int4Weight:
        """Output rows [start, start + length) (column-parallel sharding, q/k/v splits)."""
        return Int4Weight(self.qweight.narrow(0, start, length),
                          self.scale.narrow(0, start, length),
                          self.offset.narrow(0, start, length), self.group_size,
                          self.column_order)

    def columns(self, start: int, length: int) -> Int4Weight:
        """Input features [start, start + length), on group boundaries (row-parallel)."""
        g = self.group_size
        if (start, length) == (0, self.shape[1]):
            return self
        if self.column_order is not None:
            raise ValueError("an act-order (desc_act) 4-bit weight cannot be split by input "
                             "feature: its groups span the whole row (use tensor parallelism "
                             "1, or a checkpoint quantised without desc_act)")
        check_group_aligned(start, length, g)
        return Int4Weight(self.qweight.narrow(1, start, length),
                          self.scale.narrow(1, start // g, length // g),
                          self.offset.narrow(1, start // g, length // g), g)

    def permute_rows(self, index: torch.Tensor) -> Int4Weight:
        """Rows reordered by `index` (e.g. undoing GGUF's rotary interleave of q/k)."""
        return Int4Weight(self.qweight.index_select(0, index), self.scale.index_select(0, index),
                          self.offset.index_select(0, index), self.group_size, self.column_order)

    def split_groups(self, group_size: int) -> Int4Weight:
        """The same matrix with smaller groups (each old group's scale repeated): exact."""
        if group_size == self.group_size:
            return self
        if group_size > self.group_size or self.group_size % group_size:
            raise ValueError(f"groups of {self.group_size} cannot be split into groups of "
                             f"{group_size}")
        r = self.group_size // group_size
        return Int4Weight(self.qweight, self.scale.repeat_interleave(r, dim=1),
                          self.offset.repeat_interleave(r, dim=1), group_size, self.column_order)

    def contiguous(self) -> Int4Weight:
        """Own copies of the data (a shard no longer keeps the whole tensor alive)."""
        order = None if self.column_order is None else self.column_order.clone()
        return Int4Weight(self.qweight.contiguous().clone(), self.scale.contiguous().clone(),
                          self.offset.contiguous().clone(), self.group_size, order)

    def to(self, device: torch.device | str) -> Int4Weight:
        order = None if self.column_order is None else self.column_order.to(device)
        return Int4Weight(self.qweight.to(device), self.scale.to(device),
                          self.offset.to(device), self.group_size, order)

    @staticmethod
    def cat_rows(parts: list[Int4Weight]) -> Int4Weight:
        """Stack weights over the same input features (fused q/k/v, gate/up) row-wise; groups
        are split to the smallest group size among them."""
        if not parts:
            raise ValueError("no 4-bit weights to concatenate")
        g = min(p.group_size for p in parts)
        parts = [p.split_groups(g) for p in parts]
        order = parts[0].column_order
        for p in parts[1:]:
            same = (p.column_order is None) == (order is None) and (
                order is None or torch.equal(p.column_order, order))
            if not same:
                raise ValueError("fused 4-bit weights (q/k/v or gate/up) have different "
                                 "act-order column orders; they cannot share one input")
        return Int4Weight(torch.cat([p.qweight for p in parts]),
                          torch.cat([p.scale for p in parts]),
                          torch.cat([p.offset for p in parts]), g, order)


def check_group_aligned(start: int, length: int, group_size: int) -> None:
    """Refuse a run of input features that does not start and end on group boundaries."""
    if start % group_size or length % group_size:
        raise ValueError(f"input features [{start}, {start + length}) split a group of "
                         f"{group_size}: choose a tensor-parallel degree that divides the "
                         "groups (row-parallel layers shard input features)")
