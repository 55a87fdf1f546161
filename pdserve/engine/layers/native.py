"""A linear layer's forward as data, for the C++ decode loop (kernels/cpu/flat_decoder.cpp).

The Python flat loop binds each linear's forward as a callable (`LinearBase.flat_forward`); the
C++ loop cannot call Python, so a linear that can be run there describes its forward instead
(`LinearBase.native_forward`): which operator, on which tensors, with which biases.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class NativeKind(enum.IntEnum):
    """The operator; the values are FlatDecoder's `LinearKind`."""

    DENSE = 0
    """`F.linear(x, weight, bias)` (through oneDNN where `kernels.onednn` takes it)."""
    INT4 = 1
    """`pdserve_layers::int4_linear(x, packed, scale, offset, group)`."""
    INT4_ROWWISE = 2
    """`pdserve_layers::int4_linear_rowwise`, the batch-invariant form."""


@dataclass(frozen=True)
class NativeLinear:
    kind: NativeKind
    tensors: tuple[torch.Tensor, ...]
    """DENSE: (weight,); INT4*: (packed, scale, offset)."""
    group: int = 0
    bias: torch.Tensor | None = None
    """Inside the product (DENSE only), as `F.linear` takes it."""
    post_bias: torch.Tensor | None = None
    """Added to the product after it, as a row-parallel or 4-bit layer's forward does."""
