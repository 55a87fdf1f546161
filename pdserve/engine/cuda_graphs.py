"""Decode steps replayed as CUDA graphs, one per batch size of a ladder (CUDA only).

A decode-only step's forward is captured once per bucket size B (1, 2, 4, 8, then steps of
8 up to `max_batch`) over static input buffers: token ids, positions, slot mapping, context
lengths and a block table as wide as the longest sequence. A step of b requests replays
the smallest bucket >= b after copying its inputs into the first b rows; the padding rows
write no KV (slot -1, which every backend's `write_kv` skips) and attend over one token of
block 0, and their outputs are dropped. Larger batches than the ladder run eager. Attention
must be `traceable` (Triton: its decode kernel is launched with the capture's fixed
`max_seq_len`, so the split count is the same at every replay).

Lifecycle per bucket: NOT CAPTURED --first step of that size--> CAPTURED (replayed after).
"""

from __future__ import annotations

import torch

from pdserve.engine.attention.metadata import AttentionMetadata


def batch_ladder(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... up to and including max_batch."""
    sizes = [b for b in (1, 2, 4, 8) if b <= max_batch]
    sizes += list(range(16, max_batch + 1, 8))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class CudaGraphDecode:
    any_step = False  # graphs are captured for decode-only batches

    def __init__(self, model: torch.nn.Module, device: torch.device, *, max_batch: int = 64,
                 max_blocks: int = 256, max_seq_len: int = 4096) -> None:
        self.model = model
        self.device = device
        self.ladder = batch_ladder(max_batch)
        self.max_seq_len = max_seq_len
        n, z = self.ladder[-1], dict(dtype=torch.int64, device=device)
        self.ids, self.pos = torch.zeros(n, **z), torch.zeros(n, **z)
        self.slots, self.lens = torch.full((n,), -1, **z), torch.ones(n, **z)
        self.tables = torch.zeros((n, max_blocks), **z)
        self.qstart = torch.arange(n + 1, **z)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def __call__(self, input_ids, positions, caches, meta: AttentionMetadata, backend):
        b = input_ids.shape[0]
        bucket = next((s for s in self.ladder if s >= b), None)
        if bucket is None or meta.block_tables.shape[1] > self.tables.shape[1]:
            return self.model(input_ids, positions, caches, meta, backend)
        self._load(input_ids, positions, meta)
        if bucket not in self.graphs:
            self.graphs[bucket] = self._capture(bucket, caches, backend)
        graph, out = self.graphs[bucket]
        graph.replay()
        return out[:b]

    def _load(self, input_ids, positions, meta: AttentionMetadata) -> None:
        b, w = input_ids.shape[0], meta.block_tables.shape[1]
        self.ids[:b].copy_(input_ids)
        self.pos[:b].copy_(positions)
        self.slots[:b].copy_(meta.slot_mapping)
        self.lens[:b].copy_(meta.seq_lens_t)
        self.tables[:b, :w].copy_(meta.block_tables)
        self.tables[:b, w:].zero_()
        self.slots[b:].fill_(-1)  # padding rows: no KV written, one token of block 0 read
        self.lens[b:].fill_(1)
        self.tables[b:].zero_()

    def _static_meta(self, bucket: int, backend) -> AttentionMetadata:
        meta = AttentionMetadata(
            query_start=list(range(bucket + 1)), seq_lens=[self.max_seq_len] * bucket,
            block_tables=self.tables[:bucket], slot_mapping=self.slots[:bucket],
            seq_lens_t=self.lens[:bucket], query_start_t=self.qstart[:bucket + 1],
            max_query_len=1, max_seq_len=self.max_seq_len)
        return backend.prepare(meta)

    def _capture(self, bucket: int, caches, backend) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        meta = self._static_meta(bucket, backend)
        args = (self.ids[:bucket], self.pos[:bucket], caches, meta, backend)
        # The warm-up runs write the real rows' KV too: the same values the replay writes.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.model(*args)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.model(*args)
        self.pool = graph.pool()
        return graph, out


def graph_args(max_num_seqs: int, max_model_len: int, block_size: int) -> dict:
    """CudaGraphDecode's sizes for an engine's limits."""
    return {"max_batch": max_num_seqs, "max_blocks": -(-max_model_len // block_size),
            "max_seq_len": max_model_len}
