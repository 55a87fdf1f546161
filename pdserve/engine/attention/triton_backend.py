"""Triton attention backend: paged KV writes and paged attention through pdserve.kernels.

Decode-only batches (every request has one query token) take the split-KV decode kernel; any
batch with a longer query segment (prefill chunk, speculative verification, mixed batch) takes
the general causal kernel, which also handles its single-token rows. A uint8 cache (the packed
FP8 format of `pdserve.engine.quant.kv_fp8`) is quantised on write and dequantised on read inside
the kernels. Same contract and results as the torch reference (`torch_ref.TorchAttention`),
which the tests use as the oracle.
"""

from __future__ import annotations

import torch

from pdserve.engine.attention.backend import AttentionBackend
from pdserve.engine.attention.metadata import AttentionMetadata
from pdserve.kernels.kv_write import write_kv
from pdserve.kernels.paged_attention import paged_decode_attention, paged_prefill_attention


class TritonAttention(AttentionBackend):
    name = "triton"

    def traceable(self, cache: torch.Tensor) -> bool:
        return True  # no host reads of per-step values: CUDA graphs can capture it

    def write_kv(self, cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        write_kv(cache, k, v, meta.slot_mapping)

    def attend(self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, sliding_window: int | None) -> torch.Tensor:
        args = (q, cache, meta.block_tables, meta.seq_lens_t, meta.query_start_t, scale,
                sliding_window)
        if meta.is_decode_only:
            return paged_decode_attention(*args, max_seq_len=meta.max_seq_len)
        return paged_prefill_attention(*args, max_query_len=meta.max_query_len)
