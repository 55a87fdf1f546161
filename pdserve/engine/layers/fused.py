"""The per-layer small ops (RMSNorm, residual add + RMSNorm, rotary, the MLP's silu * up)
through pdserve's C++ library (`pdserve_layers`, kernels/cpu/layer_ops.cpp) where it applies:
CPU, fp32, and the library built. Elsewhere the callers run their torch expressions, which are
the reference.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


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


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] on the last dim: one C++ call on the CPU in
    fp32 (the same bits as the torch expression where the library is built for the ISA torch
    dispatches to), else the expression."""
    ops = cpu_ops_for(gate_up)
    if ops is not None and gate_up.dim() == 2:
        return ops.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
