"""An 8-bit copy of the LM head's weight: int8 values, one fp32 scale per 32 of a row's inputs.

Under W4A16 the linear layers read ~66 MB per decode step and an fp32 LM head (a 49k x 576
tied embedding) another 113 MB: the head, not the 4-bit layers, set the step. This copy is
~0.28 of that. Symmetric quantisation in groups of 32 (scale = max|w| / 127 of the group, as
GGUF's Q8_0) keeps top-1 agreement with the fp32 head on real text; one scale per row lost
2 points of it (docs/perf.md). The product runs in fp32 activations with fp32
logits (`pdserve_layers::int8_linear`, a C++ CPU kernel): bf16 logits would tie tokens that
fp32 logits tell apart.

Without the kernel (no compiler, another device) the weight is dequantised once and
multiplied densely: the same values, none of the saving (warned once).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.layers.linear import LinearMethod

log = logging.getLogger(__name__)

_QMAX = 127
GROUP_SIZE = 32


def group_size(in_features: int) -> int:
    """Groups of 32 inputs, or the whole row when 32 does not divide it."""
    return GROUP_SIZE if in_features % GROUP_SIZE == 0 else in_features


def quantize_groups(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [N, K], fp32 scale [N, K / group]) with w[n, i] ~= q[n, i] * scale[n, i // group];
    an all-zero group gets scale 1."""
    n, k = w.shape
    if group <= 0 or k % group:
        raise ValueError(f"int8 groups of {group} do not divide {k} inputs")
    wg = w.float().reshape(n, k // group, group)
    amax = wg.abs().amax(dim=2)
    scale = torch.where(amax > 0, amax / _QMAX, torch.ones_like(amax))
    q = torch.round(wg / scale[..., None]).clamp_(-_QMAX, _QMAX).to(torch.int8)
    return q.reshape(n, k), scale.contiguous()


class Int8HeadMethod(LinearMethod):
    """`keep_dense`: leave the dense weight in place after copying (a tied embedding uses it)."""

    def __init__(self, keep_dense: bool = True) -> None:
        self.keep_dense = keep_dense
        self.qweight: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None
        self._ops = None
        self._dense: torch.Tensor | None = None

    def finalize(self, layer: nn.Module) -> None:
        w = layer.weight.data
        self.qweight, self.scale = quantize_groups(w, group_size(w.shape[1]))
        if layer.weight.device.type == "cpu":
            from pdserve.kernels.cpu import load_layer_ops

            self._ops = load_layer_ops()
        if self._ops is None:
            log.warning("no int8 kernel here: the LM head's int8 copy is dequantised and "
                        "multiplied densely (no memory or speed saving)")
            self._dense = self.dequantize()
        if not self.keep_dense:
            w = layer.weight
            layer.weight = nn.Parameter(torch.empty(0, dtype=w.dtype, device=w.device),
                                        requires_grad=False)

    def state_tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in (self.qweight, self.scale, self._dense) if t is not None)

    @property
    def on_kernel(self) -> bool:
        """True when the product runs pdserve's int8 kernel (not a dense fallback)."""
        return self._ops is not None

    def dequantize(self) -> torch.Tensor:
        group = self.qweight.shape[1] // self.scale.shape[1]
        return self.qweight.float() * self.scale.repeat_interleave(group, dim=1)

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).float()
        if self._ops is not None:
            out = self._ops.int8_linear(flat, self.qweight, self.scale)
        else:
            out = F.linear(flat, self._dense)
        out = out.reshape(*x.shape[:-1], out.shape[-1]).to(x.dtype)
        return out if bias is None else out + bias

    def nbytes(self) -> int:
        return self.qweight.numel() + self.scale.numel() * 4
