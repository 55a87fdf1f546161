"""W4A16 routed experts: each expert's gate/up and down matrices held at 4 bits, multiplied by
the dense int4 layers' kernel.

Lifecycle of one `FusedExperts` layer (one `Int4ExpertsMethod` per layer):

    prepare     the stacked dense `w13_weight` / `w2_weight` become empty placeholders: no
                dense expert weight is ever held (a 64-expert layer's would be most of RAM)
    load  (xN)  each expert matrix, dense or `Int4Weight` (GPTQ / AWQ), is cut to this rank's
                `Shard` by `int4_part` exactly as a dense layer's (groups from the full input
                width; a down-projection shard that splits a group is refused) and kept as a
                part: gate at row 0 and up at row I of the expert's w13, down alone in its w2
    finalize    per expert: gate/up stacked (`stack_row_parts`, every row loaded once), then
                both matrices packed for the device's kernel (`build_int4_matmul`); a layer that
                received no part (a test filling the stacked weights directly) quantises the
                dense stacks instead and releases them

`gate_up` / `down` run one expert over its rows: on CPU `_weight_int4pack_mm_for_cpu` with
bf16 activations, scales and zeros, fp32 accumulation, the output back in the model's dtype,
as in `int4`. The grouped path calls them once per expert per step, so each expert's packed
weight is read once whatever its token count; nothing is dequantised per step.

What stays in full precision, and why: the router (`GateLinear`, fp32: a 4-bit rounding flip
of a near-tied score sends a token through another expert, an error far larger than any
weight's) and Qwen2-MoE's shared-expert gate (one scalar per token, [1, H]: nothing to save).
The shared expert is a `SharedExpert` of ordinary linear layers and takes the scheme's
`Int4LinearMethod` like every dense MLP: every token reads it, so leaving it dense would keep
the largest per-token weight read of DeepSeek / Qwen2-MoE blocks at full width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pdserve.engine.layers.linear import Loaded, Shard
from pdserve.engine.layers.moe import ExpertsMethod, FusedExperts
from pdserve.engine.quant.int4 import int4_part, stack_row_parts
from pdserve.engine.quant.int4_kernels import Int4Matmul, build_int4_matmul
from pdserve.engine.quant.int4_quantize import (
    DEFAULT_GROUP_SIZE,
    default_group_size,
    quantize_int4,
)
from pdserve.engine.quant.int4_weight import Int4Weight

_STACKS = ("w13", "w2")


@dataclass(frozen=True)
class _ExpertMatrix:
    """One expert's packed [N, K] matrix and, for act-order GPTQ, its input permutation."""

    kernel: Int4Matmul
    column_order: torch.Tensor | None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.column_order is not None:
            x = x.index_select(1, self.column_order)
        return self.kernel.matmul(x)

    def dequantize(self) -> torch.Tensor:
        w = self.kernel.dequantize()
        if self.column_order is not None:
            w = torch.empty_like(w).index_copy_(1, self.column_order, w)
        return w


class Int4ExpertsMethod(ExpertsMethod):
    """`group_size`, `kernel`, `accept_dense`: as `Int4LinearMethod`'s (a GPTQ / AWQ
    checkpoint's dense expert weight would be a mixed-precision file: refused)."""

    def __init__(self, group_size: int = DEFAULT_GROUP_SIZE, kernel: str = "auto",
                 accept_dense: bool = True) -> None:
        self.group_size = group_size
        self.kernel_name = kernel
        self.accept_dense = accept_dense
        self._dtype: torch.dtype | None = None
        self._parts: dict[tuple[int, str], dict[int, Int4Weight]] = {}  # until finalize
        self._w13: list[_ExpertMatrix] = []
        self._w2: list[_ExpertMatrix] = []

    def prepare(self, layer: FusedExperts) -> None:
        """Before loading: drop the dense stacks (loading never writes into them)."""
        self._dtype = layer.w13_weight.dtype
        for name in _STACKS:
            w = getattr(layer, f"{name}_weight")
            setattr(layer, f"{name}_weight", nn.Parameter(
                torch.empty(0, dtype=w.dtype, device=w.device), requires_grad=False))

    def load(self, layer: FusedExperts, param: nn.Parameter, local: int, part: str,
             loaded: Loaded, shard: Shard | None) -> None:
        stack = "w2" if part == "w2" else "w13"
        expert = layer.expert_start + local
        what = (f"4-bit expert {expert} {part} with {loaded.shape[1]} input features, tensor "
                f"parallelism {layer.tp.size}")
        piece = int4_part(loaded, shard, self.group_size, self.accept_dense, what)
        parts = self._parts.setdefault((local, stack), {})
        row = 0 if shard is None else shard.dest_row
        if row in parts:
            raise ValueError(f"{what}: rows from {row} were loaded twice")
        parts[row] = piece.to(param.device)

    def finalize(self, layer: FusedExperts) -> None:
        dtype = self._dtype or layer.w13_weight.dtype
        shapes = {"w13": (2 * layer.intermediate, layer.hidden),
                  "w2": (layer.hidden, layer.intermediate)}
        from_dense = not self._parts and layer.w13_weight.numel() > 0
        matrices: dict[str, list[_ExpertMatrix]] = {name: [] for name in _STACKS}
        for local in range(layer.num_local):
            for name in _STACKS:
                if from_dense:
                    dense = getattr(layer, f"{name}_weight").data[local]
                    weight = quantize_int4(dense, default_group_size(dense.shape[1],
                                                                     self.group_size))
                else:
                    weight = stack_row_parts(
                        self._parts.get((local, name), {}), *shapes[name],
                        f"4-bit expert {layer.expert_start + local} {name}")
                matrices[name].append(self._pack(weight, dtype))
        self._parts = {}
        self._w13, self._w2 = matrices["w13"], matrices["w2"]
        self._dtype = dtype
        if from_dense:
            self.prepare(layer)  # release the dense stacks

    def _pack(self, weight: Int4Weight, dtype: torch.dtype) -> _ExpertMatrix:
        plain = Int4Weight(weight.qweight, weight.scale, weight.offset, weight.group_size)
        return _ExpertMatrix(build_int4_matmul(plain, dtype, self.kernel_name),
                             weight.column_order)

    def gate_up(self, layer: FusedExperts, expert: int, x: torch.Tensor) -> torch.Tensor:
        return self._w13[expert].matmul(x)

    def down(self, layer: FusedExperts, expert: int, h: torch.Tensor) -> torch.Tensor:
        return self._w2[expert].matmul(h)

    def dequantize(self, local: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Local expert `local`'s fp32 w13 [2I, H] and w2 [H, I], the matrices the kernels
        multiply by, in input-feature order (tests build their dense reference from these)."""
        return self._w13[local].dequantize(), self._w2[local].dequantize()

    def nbytes(self) -> int:
        """Bytes every expert's packed weights, scales and zeros take."""
        return sum(m.kernel.nbytes() for m in self._w13 + self._w2)

    def kernel_names(self) -> set[str]:
        return {m.kernel.name for m in self._w13 + self._w2}
