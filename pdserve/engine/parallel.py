"""The tensor-parallel group a model shard belongs to.

Passed explicitly to every TP-aware layer (no process-global state). With `size == 1` every
collective is the identity, so the single-process engine is just the degenerate case. The
collectives call the process group object directly, so no default (global) process group is
ever needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ParallelContext:
    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup when size > 1
    expert_parallel: bool = False
    """MoE layers give each rank whole experts (E / size of them) instead of a slice of every
    expert's intermediate dimension; either way one all-reduce per MoE block."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tp rank {self.rank} outside group of size {self.size}")
        if self.size > 1 and self.group is None:
            raise ValueError("a tensor-parallel context of size > 1 needs a process group")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        self.group.allreduce([x]).wait()
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate each rank's shard along the last dimension, in rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.group.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)


SINGLE = ParallelContext()
