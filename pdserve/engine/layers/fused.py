"""The per-layer small ops (RMSNorm, residual add + RMSNorm, rotary) through pdserve's C++
library (`pdserve_layers`, kernels/cpu/layer_ops.cpp) where it applies: CPU, fp32, and the
library built. Elsewhere the callers run their torch expressions, which are the reference.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _ops():
    from pdserve.kernels.cpu import load_layer_ops

    return load_layer_ops()


def cpu_ops_for(x: torch.Tensor):
    """torch.ops.pdserve_layers when `x` can go through it, else None. The ops have no
    backward: with gradients on (a drafter being fitted) the torch expressions run."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or torch.is_grad_enabled():
        return None
    return _ops()
