"""fp32 products on the CPU through torch's oneDNN, where torch has it.

    linear(x, weight, bias)   # F.linear's result; oneDNN computes it when `takes` says so

MKL's sgemm, behind F.linear, takes its AVX2 path on AMD CPUs: on the Zen 5 EPYC the real
default model's shapes ran 1.8-2.3x faster through oneDNN (`mkldnn::_linear_pointwise`, the
op inductor's CPU backend calls) at every batch size, and 3.4x for its LM head at one row
(docs/perf.md). The test is the C++ kernels' (kernels/cpu/onednn.h), so the Python and C++
decode loops run the same product on the same bits. `torch.backends.mkldnn.enabled = False`
turns it off (F.linear then), as it does for torch's own oneDNN paths. Under torch.compile
it is F.linear too: inductor lowers that itself (and cannot lower the op as called here).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


@functools.cache
def _has_op() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                            "_linear_pointwise")


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear(x, weight, ...)` goes through oneDNN."""
    return (not torch.compiler.is_compiling() and x.device.type == "cpu"
            and x.dtype == torch.float32 and weight.dtype == torch.float32
            and weight.dim() == 2 and x.numel() > 0 and torch.backends.mkldnn.enabled
            and _has_op())


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through oneDNN where it `takes` the product."""
    if takes(x, weight):
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [],
                                                  None)
    return F.linear(x, weight, bias)
