"""Tensor-parallel linear layers that shard their own weights at load time.

Column-parallel layers split the output features across ranks (no communication); row-parallel
layers split the input features and all-reduce the partial outputs. Each layer's
`weight_loader(param, loaded, shard_id)` takes a full checkpoint tensor and copies in this
rank's slice, so checkpoints never need resharding offline.

The matmul itself goes through `self.method` (a `LinearMethod`), so quantised schemes replace
only the method, not the layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.parallel import SINGLE, ParallelContext


class LinearMethod:
    """How a linear layer multiplies: plain dense weights here; quantisation overrides this."""

    def apply(self, layer: LinearBase, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)

    def finalize(self, layer: LinearBase) -> None:
        """Called once after all weights are loaded (quantise, repack, ...)."""


class LinearBase(nn.Module):
    quantizable = True
    """False keeps the layer's dense weight under any quantisation scheme (a layer whose
    weight is also read directly, e.g. MLA's kv_b_proj in the absorbed attention)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 tp: ParallelContext) -> None:
        super().__init__()
        self.tp = tp
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False)
                     if bias else None)
        self.method = LinearMethod()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)


class ReplicatedLinear(LinearBase):
    """The whole matrix on every rank, no communication (e.g. MLA's latent projection, whose
    output every rank needs in full)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32, tp: ParallelContext = SINGLE) -> None:
        super().__init__(in_features, out_features, bias, dtype, tp)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(loaded)


def _shard_rows(loaded: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    rows = loaded.shape[0] // size
    return loaded.narrow(0, rank * rows, rows)


class ColumnParallelLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32, tp: ParallelContext = SINGLE) -> None:
        if out_features % tp.size:
            raise ValueError(f"{out_features} output features do not split over TP={tp.size}")
        super().__init__(in_features, out_features // tp.size, bias, dtype, tp)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(_shard_rows(loaded, self.tp.rank, self.tp.size))


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel projections stored as one matrix (e.g. gate and up)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False,
                 dtype: torch.dtype = torch.float32, tp: ParallelContext = SINGLE) -> None:
        if any(s % tp.size for s in out_sizes):
            raise ValueError(f"output sizes {out_sizes} do not split over TP={tp.size}")
        self.shard_sizes = [s // tp.size for s in out_sizes]
        super().__init__(in_features, sum(self.shard_sizes), bias, dtype, tp)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        offset = sum(self.shard_sizes[:shard_id])
        size = self.shard_sizes[shard_id]
        param.data.narrow(0, offset, size).copy_(_shard_rows(loaded, self.tp.rank, self.tp.size))


class QKVParallelLinear(LinearBase):
    """Q, K and V projections in one matrix, split by heads.

    When there are fewer KV heads than ranks, each KV head is replicated on `size / kv_heads`
    consecutive ranks (the ranks whose query heads use it), as GQA requires.
    """

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, dtype: torch.dtype = torch.float32,
                 tp: ParallelContext = SINGLE) -> None:
        if num_heads % tp.size:
            raise ValueError(f"{num_heads} attention heads do not split over TP={tp.size}")
        if num_kv_heads % tp.size and tp.size % num_kv_heads:
            raise ValueError(f"{num_kv_heads} KV heads neither split nor replicate over "
                             f"TP={tp.size}")
        self.head_dim = head_dim
        self.num_heads = num_heads // tp.size
        self.num_kv_heads = max(1, num_kv_heads // tp.size)
        self.kv_head_start = kv_head_start(num_kv_heads, tp.rank, tp.size)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        super().__init__(hidden, out, bias, dtype, tp)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, src = 0, loaded.narrow(0, self.tp.rank * q, q)
        else:
            offset = q if shard_id == "k" else q + kv
            src = loaded.narrow(0, self.kv_head_start * self.head_dim, kv)
        param.data.narrow(0, offset, src.shape[0]).copy_(src)


def kv_head_start(num_kv_heads: int, rank: int, size: int) -> int:
    """First KV head held by `rank` (heads split when plentiful, replicated when scarce)."""
    if num_kv_heads >= size:
        return rank * (num_kv_heads // size)
    return rank * num_kv_heads // size


class RowParallelLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32, tp: ParallelContext = SINGLE) -> None:
        if in_features % tp.size:
            raise ValueError(f"{in_features} input features do not split over TP={tp.size}")
        super().__init__(in_features // tp.size, out_features, bias, dtype, tp)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param is not self.weight:
            # Per-output-row tensors (the bias, added once after the reduction; FP8
            # weight scales) are not split: every rank holds all output rows.
            param.data.copy_(loaded)
            return
        cols = loaded.shape[1] // self.tp.size
        param.data.copy_(loaded.narrow(1, self.tp.rank * cols, cols))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias joins after the reduction so it is added once, not once per rank.
        out = self.tp.all_reduce(self.method.apply(self, x, None))
        return out if self.bias is None else out + self.bias
