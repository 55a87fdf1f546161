"""CPU paged attention that reads the cache blocks in place (C++ kernel, pdserve.kernels.cpu).

Query segments the kernel is quicker for go to it, which walks each request's block table and
reads its K and V rows where they lie: no gathered copy of the context per layer. Those are
decode rows and speculative verifications (up to `MAX_KERNEL_QUERY` tokens, at any context),
and short prompt chunks, whose query tokens times context are at most `MAX_KERNEL_PAIRS`.
Longer segments keep the torch reference's SDPA path: there the one gather per chunk is shared
by every query token and SDPA's blocked matmuls win. The packed FP8 KV cache is not read by
the kernel: an FP8 cache runs the reference, whole (`TorchAttention`).

Why short prompts go to the kernel: a step whose every row is the kernel's runs the C++
decode loop (`engine/flat_decode.py`), without the modules' Python, and the kernel splits a
prompt's rows over the threads and reads each run's keys only up to its last token (the causal
half is skipped). On the default model a prompt of 32-512 tokens prefilled in 0.83-0.95x the
time that way (docs/perf.md); at 1024 tokens the kernel's unblocked attention made it 1.06x,
at 2048 1.47x.

Which rows go where is decided once per step in `prepare` (not once per layer).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from pdserve.engine.attention.metadata import AttentionMetadata
from pdserve.engine.attention.torch_ref import TorchAttention
from pdserve.engine.quant.kv_fp8 import is_packed_fp8
from pdserve.kernels.cpu import load_ops

MAX_KERNEL_QUERY = 16
"""Query segments up to this many tokens go to the kernel whatever their context."""
MAX_KERNEL_PAIRS = 512 * 512
"""Longer segments go to the kernel while query tokens x context tokens stay within this (a
fresh 512-token prompt); the rest run SDPA over a gather."""


def kernel_segment(query_len: int, context_len: int) -> bool:
    """Whether a query segment of `query_len` tokens ending at `context_len` goes to the
    kernel (see the module doc)."""
    return query_len <= MAX_KERNEL_QUERY or query_len * context_len <= MAX_KERNEL_PAIRS


@dataclass(frozen=True)
class CpuStepPlan:
    kernel_seqs: torch.Tensor
    """[n] int64: batch indices of the requests the kernel attends."""
    reference_seqs: tuple[int, ...]
    """Batch indices of the requests with long query segments (reference SDPA path)."""


class CpuPagedAttention(TorchAttention):
    name = "cpu"

    def __init__(self, every_row: bool = False) -> None:
        """`every_row`: every query segment to the kernel, prefill chunks too (the engine's
        batch-invariant mode: one method for every row, however its prompt was chunked)."""
        self.every_row = every_row
        self.ops = load_ops()
        if self.ops is None:
            raise RuntimeError("the CPU attention kernels could not be built here (see the "
                               "warning); use attention_backend='torch'")

    def prepare(self, meta: AttentionMetadata) -> AttentionMetadata:
        qs = meta.query_start
        if self.every_row:
            short, long = list(range(meta.num_seqs)), ()
        else:
            kernel = [kernel_segment(qs[i + 1] - qs[i], meta.seq_lens[i])
                      for i in range(meta.num_seqs)]
            short = [i for i, k in enumerate(kernel) if k]
            long = tuple(i for i, k in enumerate(kernel) if not k)
        plan = CpuStepPlan(torch.tensor(short, dtype=torch.int64), long)
        return replace(meta, backend_plan=plan)

    def kernel_rows(self, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """This step's rows for `ops.paged_attention` when its attention is the kernel's alone
        (every row planned for it, an fp32 cache it reads), as `write_kv` and `attend` would
        run it; else None. What a flat decode loop (`engine/flat_decode.py`) calls it with."""
        plan = meta.backend_plan
        if not isinstance(plan, CpuStepPlan) or plan.reference_seqs or cache.dtype != torch.float32:
            return None
        return plan.kernel_seqs

    def traceable(self, cache: torch.Tensor) -> bool:
        return not is_packed_fp8(cache)

    def write_kv(self, cache, k, v, meta):
        if is_packed_fp8(cache) or k.dtype != cache.dtype:
            return super().write_kv(cache, k, v, meta)
        # Strided k and v (slices of the qkv projection) are fine: each head row is contiguous.
        if k.stride(-1) != 1 or v.stride(-1) != 1:
            k, v = k.contiguous(), v.contiguous()
        self.ops.write_kv(cache, k, v, meta.slot_mapping)

    def attend(self, q, cache, meta, scale, sliding_window):
        plan = meta.backend_plan
        if is_packed_fp8(cache) or q.dtype != cache.dtype or not isinstance(plan, CpuStepPlan):
            return super().attend(q, cache, meta, scale, sliding_window)
        q = q.contiguous()
        out = torch.empty_like(q)
        if plan.kernel_seqs.numel():
            self.ops.paged_attention(out, q, cache, meta.block_tables, meta.seq_lens_t,
                                     meta.query_start_t, plan.kernel_seqs, scale,
                                     sliding_window or 0)
        qs = meta.query_start
        for i in plan.reference_seqs:
            s, e = qs[i], qs[i + 1]
            out[s:e] = self._prefill(q[s:e], cache, meta.block_tables[i], meta.seq_lens[i],
                                     scale, sliding_window)
        return out
