"""A bf16 copy of a layer's weight for its matmul (the LM head's middle option under int4).

The dense weight stays as it is (a tied embedding looks tokens up in it); `finalize` makes a
bf16 copy, and `apply` multiplies bf16 activations by it and returns the model's dtype. Half
the bytes of an fp32 head per decode step, and bf16's 8-bit mantissa keeps logits within
~0.4% of the fp32 ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.layers.linear import LinearMethod


class Bf16CopyMethod(LinearMethod):
    """`keep_dense`: leave the dense weight in place after copying (a tied embedding uses it)."""

    def __init__(self, keep_dense: bool = True) -> None:
        self.keep_dense = keep_dense
        self.weight: torch.Tensor | None = None

    def finalize(self, layer: nn.Module) -> None:
        self.weight = layer.weight.data.to(torch.bfloat16)
        if not self.keep_dense:
            w = layer.weight
            layer.weight = nn.Parameter(torch.empty(0, dtype=w.dtype, device=w.device),
                                        requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        out = F.linear(x.to(torch.bfloat16), self.weight).to(x.dtype)
        return out if bias is None else out + bias
