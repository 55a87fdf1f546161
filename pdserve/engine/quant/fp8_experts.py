"""W8A8 FP8 routed experts: each expert's matrices quantised like an FP8 linear layer.

The stacked weights become E4M3 with a float32 scale per output row of every expert
(`w13_scale` [E, 2I, 1], `w2_scale` [E, H, 1]): quantised at `finalize`, or loaded as they are
from an FP8 checkpoint (`serialized`; its `experts.<e>.<w>.weight_scale` columns). Each
expert's matmul is `Fp8LinearMethod`'s over a view of that expert's rows, so experts share
the kernel, the per-token activation scales and the dequantising fallback of dense FP8
layers. The router and the shared expert's gate stay in full precision (they are not linear
layers here: a rounding flip of the router would change which experts run).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pdserve.engine.layers.moe import ExpertsMethod, FusedExperts
from pdserve.engine.quant.fp8 import FP8_DTYPE, Fp8LinearMethod, quantize_rows


@dataclass(frozen=True)
class _ExpertMatrix:
    """One expert's [N, K] E4M3 weight and [N, 1] scale, shaped like what `Fp8LinearMethod`
    reads from a linear layer."""

    weight: torch.Tensor
    weight_scale: torch.Tensor

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]


class Fp8ExpertsMethod(ExpertsMethod):
    def __init__(self, serialized: bool = False) -> None:
        self.serialized = serialized
        self.linear = Fp8LinearMethod(serialized=True)  # the matmul only: weights are ours
        self._w13: list[_ExpertMatrix] = []
        self._w2: list[_ExpertMatrix] = []

    @property
    def fallback_reason(self) -> str | None:
        return self.linear.fallback_reason

    def prepare(self, layer: FusedExperts) -> None:
        """Before loading: give a serialized layer FP8 weights and per-row scale columns."""
        if not self.serialized:
            return
        for name in ("w13", "w2"):
            shape = getattr(layer, f"{name}_weight").shape
            device = getattr(layer, f"{name}_weight").device
            setattr(layer, f"{name}_weight", nn.Parameter(
                torch.empty(shape, dtype=FP8_DTYPE, device=device), requires_grad=False))
            setattr(layer, f"{name}_scale", nn.Parameter(
                torch.ones(*shape[:2], 1, dtype=torch.float32, device=device),
                requires_grad=False))

    def finalize(self, layer: FusedExperts) -> None:
        if not self.serialized:
            for name in ("w13", "w2"):
                w = getattr(layer, f"{name}_weight").data
                q, scale = quantize_rows(w.reshape(-1, w.shape[-1]))
                # Reassigning drops the full-precision stack: it is freed.
                setattr(layer, f"{name}_weight",
                        nn.Parameter(q.view_as(w), requires_grad=False))
                setattr(layer, f"{name}_scale",
                        nn.Parameter(scale.view(*w.shape[:2], 1), requires_grad=False))
        self._w13 = _views(layer.w13_weight, layer.w13_scale)
        self._w2 = _views(layer.w2_weight, layer.w2_scale)

    def gate_up(self, layer: FusedExperts, expert: int, x: torch.Tensor) -> torch.Tensor:
        return self.linear.apply(self._w13[expert], x, None)

    def down(self, layer: FusedExperts, expert: int, h: torch.Tensor) -> torch.Tensor:
        return self.linear.apply(self._w2[expert], h, None)


def _views(weight: nn.Parameter, scale: nn.Parameter) -> list[_ExpertMatrix]:
    return [_ExpertMatrix(weight.data[e], scale.data[e]) for e in range(weight.shape[0])]
