"""What an attention backend needs to know about a flat batch of mixed work.

The batch is a concatenation of per-request query segments: a prefill chunk (with any amount
of cached context before it), a single decode token, or a decode token plus speculative tokens.
Request i contributes query tokens [query_start[i], query_start[i+1]) whose absolute positions
end at seq_lens[i] - 1; its KV lives in the blocks of row i of `block_tables`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    query_start: list[int]
    """Prefix sums of query lengths, len = num_seqs + 1 (Python ints for the reference loop)."""
    seq_lens: list[int]
    """Context length of each request after this step (cached + new tokens)."""
    block_tables: torch.Tensor
    """[num_seqs, max_blocks] int64 block ids, padded with 0 (masked by seq_lens)."""
    slot_mapping: torch.Tensor
    """[num_tokens] int64 cache slot (block * block_size + offset) for each new token's KV."""
    seq_lens_t: torch.Tensor
    """seq_lens as an int64 tensor on the model's device."""
    query_start_t: torch.Tensor
    """query_start as an int64 tensor on the model's device."""
    max_query_len: int
    max_seq_len: int
    backend_plan: object = None
    """What the attention backend derived from this metadata once per step
    (`AttentionBackend.prepare`); None until then."""

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
