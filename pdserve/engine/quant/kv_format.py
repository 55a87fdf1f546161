"""How a KV row is stored (the model's dtype, or packed FP8), and the name it is hashed under.

Unquantised: rows of `head_dim` elements in the model's dtype. FP8: uint8 rows of
`head_dim + 4` bytes (see `kv_fp8`). The shapes and bytes of whole blocks are
`pdserve.engine.kv_layout.KVLayout`'s.
`str()` of a format is the kv-dtype key of the block hash, so KV written in one format is never
taken for the other; for the unquantised format it is `str(dtype)` (e.g. "torch.float32"), as
before FP8 existed, so existing hashes do not change.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.quant.kv_fp8 import STORAGE_DTYPE, packed_dim


@dataclass(frozen=True)
class KVCacheFormat:
    dtype: torch.dtype
    """The model's activation dtype: what K and V are computed in and read back as."""
    fp8: bool = False
    """Store E4M3 values with a float32 scale per (token, head), packed into uint8 rows."""

    @classmethod
    def from_config(cls, kv_cache_dtype: str, dtype: torch.dtype) -> KVCacheFormat:
        if kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {kv_cache_dtype!r}")
        return cls(dtype, fp8=kv_cache_dtype == "fp8")

    @property
    def storage_dtype(self) -> torch.dtype:
        return STORAGE_DTYPE if self.fp8 else self.dtype

    def last_dim(self, head_dim: int) -> int:
        """Elements of storage_dtype per (token, head)."""
        return packed_dim(head_dim) if self.fp8 else head_dim

    def __str__(self) -> str:
        if not self.fp8:
            return str(self.dtype)
        return f"fp8_e4m3+f32_token_head_scale/{self.dtype}"
