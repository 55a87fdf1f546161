"""W4A16 linear layers: 4-bit group-quantised weights in memory and in the matmul.

Lifecycle of one layer (one `Int4LinearMethod` per layer):

    prepare     the dense weight is replaced by an empty placeholder: nothing dense is kept
    load  (xN)  each checkpoint tensor, dense or `Int4Weight`, is brought to `Int4Weight` (dense
                ones quantised with `quantize_int4`, groups chosen from the full input width),
                cut to this rank's shard (row-parallel cuts must fall on group boundaries) and
                kept as a part at its own rows (q/k/v, gate/up)
    finalize    the parts are checked to cover every row, stacked, and packed for the device's
                kernel (`int4_kernels`); a layer that received no part (the LM head, whose
                weight is the tied embedding) quantises its dense weight instead
    apply       x [.., K] in the model's dtype -> kernel -> [.., N] in the model's dtype

Dtypes: the model's dtype is what flows between layers. Inside the CPU kernel activations,
scales and zeros are bf16 (the op's only fast variant), accumulation is fp32, and the output
is cast back to the model's dtype; the Triton kernel takes the model's dtype as it is. An
act-order weight (`column_order`) permutes the input features before the matmul.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from pdserve.engine.layers.linear import LinearMethod, Loaded, Matmul, Shard
from pdserve.engine.layers.native import NativeLinear
from pdserve.engine.quant.int4_kernels import Int4Matmul, build_int4_matmul
from pdserve.engine.quant.int4_quantize import (
    DEFAULT_GROUP_SIZE,
    default_group_size,
    quantize_int4,
)
from pdserve.engine.quant.int4_weight import Int4Weight, check_group_aligned


class Int4LinearMethod(LinearMethod):
    """`group_size`: groups for weights quantised at load (halved until it divides K);
    `kernel`: auto (Triton on CUDA, torch's packed kernel on CPU), cpu, triton or reference;
    `accept_dense`: quantise dense weights handed to `load` (False for 4-bit checkpoints,
    whose dense linear weight would mean a mixed-precision file);
    `from_dense`: the layer loads its dense weight as usual and it is quantised at `finalize`
    (the LM head); `keep_dense`: leave that dense weight in place afterwards (a tied
    embedding shares it)."""

    def __init__(self, group_size: int = DEFAULT_GROUP_SIZE, kernel: str = "auto",
                 accept_dense: bool = True, from_dense: bool = False,
                 keep_dense: bool = False) -> None:
        self.group_size = group_size
        self.kernel_name = kernel
        self.accept_dense = accept_dense
        self.from_dense = from_dense
        self.keep_dense = keep_dense
        self.kernel: Int4Matmul | None = None
        self.column_order: torch.Tensor | None = None
        self._parts: dict[int, Int4Weight] = {}  # first row -> part, until finalize
        self._dtype: torch.dtype | None = None

    def prepare(self, layer: nn.Module) -> None:
        """Before loading: drop the dense weight (loading never writes into it)."""
        w = layer.weight
        self._dtype = w.dtype
        if not self.from_dense:
            layer.weight = nn.Parameter(torch.empty(0, dtype=w.dtype, device=w.device),
                                        requires_grad=False)

    def load(self, layer: nn.Module, param: nn.Parameter, loaded: Loaded,
             shard: Shard | None) -> None:
        if param is not layer.weight:  # the bias stays dense
            super().load(layer, param, loaded, shard)
            return
        tp = getattr(layer, "tp", None)
        piece = int4_part(loaded, shard, self.group_size, self.accept_dense,
                          f"4-bit layer with {loaded.shape[1]} input features, tensor "
                          f"parallelism {tp.size if tp else 1}").to(param.device)
        row = 0 if shard is None else shard.dest_row
        if row in self._parts:
            raise ValueError(f"rows from {row} of a 4-bit layer were loaded twice")
        self._parts[row] = piece

    def finalize(self, layer: nn.Module) -> None:
        dtype = self._dtype or layer.weight.dtype
        if self._parts:
            weight = stack_row_parts(self._parts, layer.out_features, layer.in_features,
                                     "4-bit layer")
        else:
            dense = layer.weight.data
            weight = quantize_int4(dense, default_group_size(dense.shape[1], self.group_size))
        self._parts = {}
        self.column_order = weight.column_order
        plain = Int4Weight(weight.qweight, weight.scale, weight.offset, weight.group_size)
        self.kernel = build_int4_matmul(plain, dtype, self.kernel_name)
        self._dtype = dtype
        if self.from_dense and not self.keep_dense:
            release_dense(layer)

    def state_tensors(self) -> tuple[torch.Tensor, ...]:
        return self.kernel.tensors() if self.kernel is not None else ()

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if self.column_order is not None:
            x2 = x2.index_select(1, self.column_order)
        out = self.kernel.matmul(x2)
        if bias is not None:
            out = out + bias
        return out.view(*lead, out.shape[-1])

    def flat_matmul(self, layer: nn.Module, bias: torch.Tensor | None) -> Matmul | None:
        if self.column_order is not None:  # act-order checkpoints permute x first
            return None
        mm = self.kernel.matmul
        return mm if bias is None else (lambda x: mm(x) + bias)

    def native_matmul(self, layer: nn.Module, bias: torch.Tensor | None) -> NativeLinear | None:
        native = self.kernel.native() if self.column_order is None else None
        return native if native is None or bias is None else replace(native, post_bias=bias)

    def dequantize(self) -> torch.Tensor:
        """The fp32 [N, K] weight the layer multiplies by, in input-feature order."""
        w = self.kernel.dequantize()
        if self.column_order is not None:
            w = torch.empty_like(w).index_copy_(1, self.column_order, w)
        return w


def release_dense(layer: nn.Module) -> None:
    """Free a dense weight nothing else uses (an untied LM head's, once it has a copy)."""
    w = layer.weight
    layer.weight = nn.Parameter(torch.empty(0, dtype=w.dtype, device=w.device),
                                requires_grad=False)


def int4_part(loaded: Loaded, shard: Shard | None, group_size: int, accept_dense: bool,
              what: str) -> Int4Weight:
    """This rank's slice of one checkpoint weight as an `Int4Weight` of its own memory: a
    4-bit one cut as it is, a dense one quantised in groups chosen from its full input width
    (never the shard's, so the numbers do not depend on the TP degree). A cut that splits a
    group is refused; `what` names the layer in the error."""
    try:
        if isinstance(loaded, Int4Weight):
            return (loaded if shard is None else shard.take(loaded)).contiguous()
        if not accept_dense:
            raise ValueError(f"a 4-bit checkpoint holds a dense {list(loaded.shape)} weight "
                             "here: mixed-precision checkpoints are not supported")
        g = default_group_size(loaded.shape[1], group_size)
        if shard is not None and shard.dim == 1:
            check_group_aligned(shard.start, shard.length, g)
        return quantize_int4(loaded if shard is None else shard.take(loaded), g)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None


def stack_row_parts(parts: dict[int, Int4Weight], rows: int, k: int, what: str) -> Int4Weight:
    """Parts keyed by their first row (fused q/k/v, gate/up) -> one [rows, k] weight; every
    row must have been loaded exactly once."""
    stacked, at = [], 0
    for start in sorted(parts):
        part = parts[start]
        if start != at:
            raise ValueError(f"{what} [{rows}, {k}]: rows {at}..{start - 1} were never loaded")
        if part.shape[1] != k:
            raise ValueError(f"{what} expects {k} input features, a part has {part.shape[1]}")
        stacked.append(part)
        at += part.shape[0]
    if at != rows:
        raise ValueError(f"{what} [{rows}, {k}]: rows {at}..{rows - 1} were never loaded")
    return Int4Weight.cat_rows(stacked)
