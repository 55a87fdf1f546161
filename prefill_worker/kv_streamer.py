"""Streams each layer's freshly computed KV blocks to the decode worker, as soon as the layer
is done: the transfer of layer L overlaps the compute of layers L+1..N.

Per request we remember the destination (address, block ids) and the first block not yet sent.
Each step, a chunk covering tokens [s, e) sends blocks from that cursor to the block holding
token e-1 (a partly filled last block is sent again, complete, by the next chunk). Blocks the
decode worker already had (`skip`) are never sent; blocks this worker had cached are sent with
the first chunk, since it never computes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.models.llama import LayerHook
from pdserve.engine.scheduler import StepPlan


@dataclass
class KVTarget:
    address: str
    block_ids: list[int]  # destination block of every prompt block
    next_block: int  # first prompt block not yet sent
    bytes_sent: int = 0


@dataclass(frozen=True)
class BlockSend:
    request_id: str
    target: KVTarget
    src: torch.Tensor  # source block ids in this worker's cache
    dst: list[int]


class KVStreamer:
    def __init__(self, sender, caches: list[torch.Tensor], block_size: int) -> None:
        self.sender = sender
        self.caches = caches
        self.block_size = block_size
        self.targets: dict[str, KVTarget] = {}
        self.sent_bytes: dict[str, int] = {}  # of finished requests, until collected

    def add(self, request_id: str, address: str, block_ids: list[int], skip: int) -> None:
        self.targets[request_id] = KVTarget(address, list(block_ids), skip)

    def plan_sends(self, plan: StepPlan) -> list[BlockSend]:
        sends = []
        for chunk in plan.chunks:
            t = self.targets.get(chunk.request_id)
            if t is None:
                continue
            last = (chunk.start + len(chunk.token_ids) - 1) // self.block_size
            first = t.next_block
            if last < first:
                continue
            src = torch.tensor(chunk.block_ids[first:last + 1], dtype=torch.int64)
            sends.append(BlockSend(chunk.request_id, t, src, t.block_ids[first:last + 1]))
            complete = (chunk.start + len(chunk.token_ids)) // self.block_size
            t.next_block = max(first, complete)
        return sends

    def layer_hook(self, sends: list[BlockSend]) -> LayerHook | None:
        if not sends:
            return None

        def hook(layer: int) -> None:
            cache = self.caches[layer]
            for s in sends:
                kv = cache.index_select(0, s.src.to(cache.device))  # a copy: safe to reuse src
                s.target.bytes_sent += kv.numel() * kv.element_size()
                self.sender.send_layer(s.target.address, s.request_id, layer, s.dst, kv)

        return hook

    def finish(self, request_id: str, meta: dict):
        """DONE marker after the request's last layer; returns the sender's future."""
        t = self.targets.pop(request_id, None)
        if t is None:
            return None
        self.sent_bytes[request_id] = t.bytes_sent
        return self.sender.finish(t.address, request_id, meta)

    def abort(self, request_id: str, reason: str) -> None:
        t = self.targets.pop(request_id, None)
        if t is not None:
            self.sender.abort(t.address, request_id, reason)
