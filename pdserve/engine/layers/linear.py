"""Tensor-parallel linear layers that shard their own weights at load time.

Column-parallel layers split the output features across ranks (no communication); row-parallel
layers split the input features and all-reduce the partial outputs. Each layer's
`weight_loader(param, loaded, shard_id)` takes a full checkpoint tensor, works out this rank's
slice of it (a `Shard`: which rows or columns, and where they land), and hands both to its
method, so checkpoints never need resharding offline.

The matmul and the weight's storage go through `self.method` (a `LinearMethod`), so quantised
schemes replace only the method, not the layer. What a loader hands over is a dense tensor or
an `Int4Weight` (4-bit checkpoints); both slice the same way (`narrow`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from pdserve.engine.layers.native import NativeKind, NativeLinear
from pdserve.engine.parallel import SINGLE, ParallelContext
from pdserve.engine.quant.int4_weight import Int4Weight
from pdserve.kernels import onednn

Loaded = torch.Tensor | Int4Weight
"""A checkpoint weight as a layer's loader receives it."""
Matmul = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Shard:
    """This rank's slice of a checkpoint tensor and where it goes in the layer's parameter."""

    dim: int
    """0: a run of output rows; 1: a run of input features (row-parallel weights)."""
    start: int
    length: int
    dest_row: int = 0
    """First row of the parameter the slice fills (fused layers: q/k/v, gate/up)."""

    def take(self, loaded: Loaded) -> Loaded:
        return loaded.narrow(self.dim, self.start, self.length)


class LinearMethod:
    """How a linear layer stores and multiplies its weight: dense here; quantisation overrides.

    `prepare` runs once before loading, `load` receives each checkpoint tensor with its shard
    (None: the whole tensor, as it is), `finalize` runs once after everything is loaded.
    """

    def prepare(self, layer: nn.Module) -> None:
        """Called once before loading (give the layer the parameters this scheme loads)."""

    def load(self, layer: nn.Module, param: nn.Parameter, loaded: Loaded,
             shard: Shard | None) -> None:
        piece = loaded if shard is None else shard.take(loaded)
        if isinstance(piece, Int4Weight):  # a 4-bit checkpoint loaded into a dense model
            piece = piece.dequantize(param.dtype)
        dest = param.data if shard is None else param.data.narrow(0, shard.dest_row,
                                                                  piece.shape[0])
        dest.copy_(piece)

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        return onednn.linear(x, layer.weight, bias)

    def flat_matmul(self, layer: nn.Module, bias: torch.Tensor | None) -> Matmul | None:
        """`x -> apply(layer, x, bias)` for a 2-D x, bound once to the loaded weights (the
        flat decode loop, `engine/flat_decode.py`), or None where a method has no such form.
        Subclasses offer their own or none: the dense one is not theirs."""
        if type(self) is not LinearMethod:
            return None
        return functools.partial(onednn.linear, weight=layer.weight, bias=bias)

    def native_matmul(self, layer: nn.Module, bias: torch.Tensor | None) -> NativeLinear | None:
        """`flat_matmul`'s call as data, for the C++ decode loop (`layers/native.py`), or
        None where a method has no such form."""
        if type(self) is not LinearMethod:
            return None
        return NativeLinear(NativeKind.DENSE, (layer.weight,), bias=bias)

    def finalize(self, layer: nn.Module) -> None:
        """Called once after all weights are loaded (quantise, repack, ...)."""

    def state_tensors(self) -> tuple[torch.Tensor, ...]:
        """Tensors the method holds besides the layer's parameters (a packed copy of the
        weight, its scales), after `finalize`: the loader moves them with the parameters
        (`huge_pages.weights_to_huge_pages`)."""
        return ()


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

    def flat_forward(self) -> Matmul | None:
        """This layer's forward for a 2-D x as one bound call, or None (tensor parallelism,
        or a method without a flat form): see `LinearMethod.flat_matmul`."""
        return self.method.flat_matmul(self, self.bias) if self.tp.size == 1 else None

    def native_forward(self) -> NativeLinear | None:
        """`flat_forward` as data (`layers/native.py`), or None."""
        return self.method.native_matmul(self, self.bias) if self.tp.size == 1 else None


class ReplicatedLinear(LinearBase):
    """The whole matrix on every rank, no communication (e.g. MLA's latent projection, whose
    output every rank needs in full)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32, tp: ParallelContext = SINGLE) -> None:
        super().__init__(in_features, out_features, bias, dtype, tp)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id=None) -> None:
        self.method.load(self, param, loaded, None)


def _rank_rows(loaded: Loaded, rank: int, size: int, dest_row: int = 0) -> Shard:
    rows = loaded.shape[0] // size
    return Shard(0, rank * rows, rows, dest_row)


class ColumnParallelLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32, tp: ParallelContext = SINGLE) -> None:
        if out_features % tp.size:
            raise ValueError(f"{out_features} output features do not split over TP={tp.size}")
        super().__init__(in_features, out_features // tp.size, bias, dtype, tp)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id=None) -> None:
        self.method.load(self, param, loaded, _rank_rows(loaded, self.tp.rank, self.tp.size))


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel projections stored as one matrix (e.g. gate and up)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False,
                 dtype: torch.dtype = torch.float32, tp: ParallelContext = SINGLE) -> None:
        if any(s % tp.size for s in out_sizes):
            raise ValueError(f"output sizes {out_sizes} do not split over TP={tp.size}")
        self.shard_sizes = [s // tp.size for s in out_sizes]
        super().__init__(in_features, sum(self.shard_sizes), bias, dtype, tp)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: int) -> None:
        offset = sum(self.shard_sizes[:shard_id])
        self.method.load(self, param, loaded,
                         _rank_rows(loaded, self.tp.rank, self.tp.size, dest_row=offset))


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

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: str) -> None:
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        if shard_id == "q":
            shard = Shard(0, self.tp.rank * q, q, dest_row=0)
        else:
            shard = Shard(0, self.kv_head_start * self.head_dim, kv,
                          dest_row=q if shard_id == "k" else q + kv)
        self.method.load(self, param, loaded, shard)


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

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id=None) -> None:
        if param is not self.weight:
            # Per-output-row tensors (the bias, added once after the reduction; FP8
            # weight scales) are not split: every rank holds all output rows.
            self.method.load(self, param, loaded, None)
            return
        cols = loaded.shape[1] // self.tp.size
        self.method.load(self, param, loaded, Shard(1, self.tp.rank * cols, cols))

    def flat_forward(self) -> Matmul | None:
        mm = self.method.flat_matmul(self, None) if self.tp.size == 1 else None
        if mm is None or self.bias is None:
            return mm
        bias = self.bias
        return lambda x: mm(x) + bias  # added after the product, as forward does

    def native_forward(self) -> NativeLinear | None:
        mm = self.method.native_matmul(self, None) if self.tp.size == 1 else None
        if mm is None or self.bias is None:
            return mm
        return replace(mm, post_bias=self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias joins after the reduction so it is added once, not once per rank.
        out = self.tp.all_reduce(self.method.apply(self, x, None))
        return out if self.bias is None else out + self.bias
