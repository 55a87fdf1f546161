"""W8A8 FP8 linear layers: E4M3 weights with per-output-channel scales, per-token activations.

At `finalize` the layer's full-precision weight is replaced by an E4M3 copy and a float32 scale
per output row (row amax / 448), unless the checkpoint already held both (`serialized`), in
which case `prepare` gave the layer FP8 parameters to load into. `apply` quantises each
activation row with its own scale and runs `torch._scaled_mm` with row-wise scales on both
operands, so the dot products accumulate in fp32 and the scales are applied once per output.

Only `LinearBase` layers take this method; embeddings and the LM head stay in full precision.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from pdserve.engine.layers.linear import LinearBase, LinearMethod

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite E4M3FN value
_MIN_SCALE = 1e-12  # an all-zero row still gets a usable (non-zero) scale

log = logging.getLogger(__name__)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] float -> (E4M3 [M, K], float32 scales [M, 1]) with x ~= q * scale per row."""
    x32 = x.float()
    scale = (x32.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=_MIN_SCALE)
    q = (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize_rows` (up to rounding): q * scale in `dtype`."""
    return (q.float() * scale.float()).to(dtype)


class Fp8LinearMethod(LinearMethod):
    """W8A8 FP8 matmul for one layer (one instance per layer: it records its own fallback).

    `serialized`: the checkpoint stores E4M3 weights and a `weight_scale` per layer, loaded
    as they are; otherwise the full-precision weight is quantised at `finalize`.
    """

    def __init__(self, serialized: bool = False) -> None:
        self.serialized = serialized
        self.fallback_reason: str | None = None
        """Why `_scaled_mm` was refused for this layer, if it was (then we dequantise)."""

    def prepare(self, layer: LinearBase) -> None:
        """Before loading: give a serialized layer FP8 weight and [N, 1] scale parameters."""
        if not self.serialized:
            return
        device = layer.weight.device
        layer.weight = nn.Parameter(
            torch.empty(layer.out_features, layer.in_features, dtype=FP8_DTYPE, device=device),
            requires_grad=False)
        layer.weight_scale = nn.Parameter(
            torch.ones(layer.out_features, 1, dtype=torch.float32, device=device),
            requires_grad=False)

    def finalize(self, layer: LinearBase) -> None:
        if self.serialized:
            return
        q, scale = quantize_rows(layer.weight.data)
        # Reassigning drops the last reference to the full-precision weight: it is freed.
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)

    def apply(self, layer: LinearBase, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        lead = x.shape[:-1]
        xq, xs = quantize_rows(x.reshape(-1, x.shape[-1]))
        out = self._matmul(layer, xq, xs, bias, x.dtype)
        return out.view(*lead, layer.out_features)

    def _matmul(self, layer: LinearBase, xq: torch.Tensor, xs: torch.Tensor,
                bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
        ws = layer.weight_scale
        if self.fallback_reason is None:
            try:
                # [N, K] row-major transposed is the column-major [K, N] operand it wants.
                return torch._scaled_mm(xq, layer.weight.t(), scale_a=xs, scale_b=ws.t(),
                                        bias=bias, out_dtype=out_dtype)
            except torch.OutOfMemoryError:
                raise
            except (RuntimeError, NotImplementedError) as e:
                self.fallback_reason = f"{type(e).__name__}: {e}"
                log.warning("torch._scaled_mm refused a [%d, %d] FP8 layer (%s); this layer "
                            "dequantises its weight instead", layer.out_features,
                            layer.in_features, self.fallback_reason)
        out = (xq.float() @ layer.weight.t().float()) * xs * ws.t()
        out = out if bias is None else out + bias.float()
        return out.to(out_dtype)
