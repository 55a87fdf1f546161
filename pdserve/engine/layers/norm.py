"""RMSNorm, computed in fp32 like the reference implementation, cast back at the end; on the
CPU in fp32 one C++ call (`layers.fused`), and `add_forward` adds the residual in the same call.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.engine.layers.fused import cpu_ops_for


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = cpu_ops_for(x)
        if ops is not None:
            flat = x.reshape(-1, x.shape[-1])
            return ops.rms_norm(flat, self.weight, self.eps).view(x.shape)
        return self.reference(x)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, norm(x + residual))."""
        ops = cpu_ops_for(x)
        if ops is not None and x.dim() == 2 and residual.dtype == x.dtype:
            return ops.add_rms_norm(x, residual, self.weight, self.eps)
        s = x + residual
        return s, self(s)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32:  # the same arithmetic without the no-op casts
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
