"""Attention backend interface and its lazy registry.

A backend writes the new tokens' K/V into the paged cache and computes attention over each
request's whole context. The cache of one layer is `[num_blocks, 2, num_kv_heads, block_size,
head_dim]` (index 0 = K, 1 = V): head-major inside a block, so one head's slice of a block is
contiguous (what tensor-parallel re-sharding during transfer wants).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod

import torch

from pdserve.engine.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    name: str = ""

    def prepare(self, meta: AttentionMetadata) -> AttentionMetadata:
        """Once per step, before the layers: derive whatever the backend would otherwise
        recompute in every layer (returned in `meta.backend_plan`). Default: nothing."""
        return meta

    def traceable(self, cache: torch.Tensor) -> bool:
        """Whether torch.compile / CUDA graphs can capture this backend's decode step over
        caches like `cache` (no Python control flow on per-step values). Default: no."""
        return False

    @abstractmethod
    def write_kv(self, cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        """Store k, v ([T, KVH, D]) at meta.slot_mapping. Mutates `cache`."""

    @abstractmethod
    def attend(self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, sliding_window: int | None) -> torch.Tensor:
        """Causal attention of q ([T, H, D]) over the cached context; returns [T, H, D]."""


_BACKENDS = {
    "torch": "pdserve.engine.attention.torch_ref:TorchAttention",
    "cpu": "pdserve.engine.attention.cpu_backend:CpuPagedAttention",
    "triton": "pdserve.engine.attention.triton_backend:TritonAttention",
}
NAMES = ("auto", *_BACKENDS)


def resolve_backend_name(name: str, device: torch.device | str | None = None) -> str:
    """"auto": triton on CUDA; on the CPU the C++ kernel backend when it builds here (a
    failed build has warned once), else the torch reference."""
    if name != "auto":
        return name
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda" or (
            device is None and torch.cuda.is_available()):
        return "triton"
    from pdserve.kernels.cpu import load_ops

    return "cpu" if load_ops() is not None else "torch"


def get_backend(name: str, device: torch.device | str | None = None) -> AttentionBackend:
    """The backend called `name` ("auto" resolved for `device`, default: CUDA if present)."""
    name = resolve_backend_name(name, device)
    if name not in _BACKENDS:
        raise ValueError(f"attention backend must be one of {sorted(_BACKENDS)}, got {name!r}")
    module, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)()
