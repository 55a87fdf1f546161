"""Streams each layer's freshly computed KV blocks to the decode worker, as soon as the layer
is done: the transfer of layer L overlaps the compute of layers L+1..N.

Rank 0 plans, per step, which blocks each request sends (`plan_sends`): from the first block
not yet sent to the block holding the chunk's last token (a partly filled last block is sent
again, complete, by the next chunk). Blocks the decode worker already had (`skip`) are never
sent; blocks this worker had cached go with the first chunk, since it never computes them.

Every rank of a tensor-parallel prefill group runs the same plan on its own KV heads and sends
each decode rank exactly the heads that rank holds (re-sharding in transit, with `head_start`
telling the receiver where the slice goes), as the engine's `KVLayout` routes them. When KV
heads are replicated across ranks, only the lowest rank holding a head sends it: an MLA
latent (one "head" every rank holds) goes from prefill rank 0 to each decode rank, once.
The `PrefillDone` with the first token goes to the decode group's rank 0; every other
(sender, receiver) pair gets a `PartsDone`.

Every send carries what is left of the decode worker's lease on the blocks (`KVTarget`):
past it, the sender drops the transfer, as the decode worker does (`pdserve.serving.kv_lease`).
Every frame is tagged under the transfer's ticket (`KVTarget.kv_ticket`, which the decode
worker made for this reservation); follower ranks get it in their `BlockSend`. So do the
decode ranks' NIXL landing pools (`KVEndpoint.nixl`): a sender with NIXL writes into them,
one without, or a rank that offers none, uses gloo.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kv_store.tp_layout import wire_request_id
from pdserve.engine.kv_layout import KVLayout
from pdserve.engine.models.llama import LayerHook
from pdserve.engine.scheduler import StepPlan
from pdserve.serving import kv_messages
from pdserve.serving.kv_lease import Lease
from pdserve.serving.kv_messages import PartsDone, PrefillDone

Endpoint = tuple[str, int, int]  # (address, tp_rank, tp_size) of a decode-side receiver
Peers = tuple[tuple[str, bytes], ...]  # (address, NIXL landing pool) of decode-side receivers


@dataclass
class KVTarget:
    endpoints: list[Endpoint]
    block_ids: list[int]  # destination block of every prompt block
    next_block: int  # first prompt block not yet sent
    lease: Lease  # the decode worker's lease on those blocks
    ticket: bytes  # the decode worker's ticket for this transfer
    peers: Peers = ()  # the decode ranks' NIXL landing pools
    bytes_sent: int = 0


@dataclass(frozen=True)
class BlockSend:
    request_id: str
    endpoints: list[Endpoint]
    src: list[int]  # source block ids in this group's caches
    dst: list[int]
    last: bool  # this step completes the prompt: DONE follows
    lease_s: float  # what is left of the transfer's lease (follower ranks start theirs here)
    ticket: bytes = field(repr=False)  # tags every frame (`KVTarget.ticket`)
    peers: Peers = field(default=(), repr=False)  # `KVTarget.peers`

    def to_wire(self) -> list:
        return [self.request_id, [list(e) for e in self.endpoints], self.src, self.dst,
                self.last, self.lease_s, self.ticket, [list(p) for p in self.peers]]

    @classmethod
    def from_wire(cls, row: list) -> BlockSend:
        rid, eps, src, dst, last, lease_s, ticket, peers = row
        return cls(rid, [(str(a), int(r), int(s)) for a, r, s in eps], list(src), list(dst),
                   bool(last), float(lease_s), bytes(ticket),
                   tuple((str(a), bytes(d)) for a, d in peers))


@dataclass
class KVStreamer:
    sender: object  # kv_store.transfer.KVSender
    caches: list[torch.Tensor]
    block_size: int
    layout: KVLayout  # the engine's: which heads (or MLA latent) each rank holds and sends
    tp_rank: int = 0
    tp_size: int = 1
    targets: dict[str, KVTarget] = field(default_factory=dict)  # rank 0's plans
    sent_to: dict[str, set[str]] = field(default_factory=dict)  # addresses per request
    sent_bytes: dict[str, int] = field(default_factory=dict)  # of finished requests
    _ranks: dict[str, int] = field(default_factory=dict)  # decode rank of each address seen

    def add(self, request_id: str, endpoints: Sequence[Endpoint], block_ids: list[int],
            skip: int, lease: Lease, ticket: bytes, peers: Peers = ()) -> None:
        """Stream `request_id`'s blocks to these decode ranks (`peers`: their NIXL landing
        pools; `ValueError` for a malformed one)."""
        for address, descriptor in peers:
            self.sender.add_peer(address, descriptor)
        self.targets[request_id] = KVTarget(list(endpoints), list(block_ids), skip, lease,
                                            ticket, tuple(peers))
        self._ranks.update((address, rank) for address, rank, _ in endpoints)

    def plan_sends(self, plan: StepPlan) -> list[BlockSend]:
        """Rank 0: what each scheduled request sends this step (advances the cursors)."""
        sends = []
        for chunk in plan.chunks:
            t = self.targets.get(chunk.request_id)
            if t is None:
                continue
            end = chunk.start + len(chunk.token_ids)
            last, first = (end - 1) // self.block_size, t.next_block
            if last >= first:
                sends.append(BlockSend(chunk.request_id, t.endpoints,
                                       chunk.block_ids[first:last + 1],
                                       t.block_ids[first:last + 1], chunk.num_samples > 0,
                                       t.lease.left(), t.ticket, t.peers))
                t.next_block = max(first, end // self.block_size)
        return sends

    def layer_hook(self, sends: Sequence[BlockSend]) -> LayerHook | None:
        if not sends:
            return None
        if self.tp_rank:  # rank 0 registered them in `add`
            for s in sends:
                for address, descriptor in s.peers:
                    self.sender.add_peer(address, descriptor)
        routes = {id(s): self._routes(s.endpoints) for s in sends}
        local0 = self.layout.heads_of(self.tp_rank, self.tp_size).start

        def hook(layer: int) -> None:
            cache = self.caches[layer]
            for s in sends:
                if not routes[id(s)]:
                    continue
                src = torch.tensor(s.src, dtype=torch.int64, device=cache.device)
                blocks = self._gather(cache, src, routes[id(s)], local0)
                for address, lo, hi in routes[id(s)]:
                    kv = blocks[:, :, lo - local0:hi - local0]
                    kv = kv if kv.is_contiguous() else kv.contiguous()
                    self.sender.send_layer(address, self._wire(s.request_id, address), layer,
                                           s.dst, kv, head_start=lo, lease_s=s.lease_s,
                                           ticket=s.ticket)
                    self.sent_to.setdefault(s.request_id, set()).add(address)
                    self.sent_bytes[s.request_id] = (self.sent_bytes.get(s.request_id, 0)
                                                     + kv.numel() * kv.element_size())

        return hook

    def _gather(self, cache: torch.Tensor, src: torch.Tensor,
                routes: list[tuple[str, int, int]], local0: int) -> torch.Tensor:
        """A copy of the blocks (the source may be reused): into a staging slot that a
        same-host decode rank reads it from when all our heads go to that one rank
        (`KVSender.stage`), else into a tensor of its own."""
        if len(routes) == 1 and routes[0][1] == local0 \
                and routes[0][2] - local0 == cache.shape[2]:
            out = self.sender.stage(routes[0][0], (len(src), *cache.shape[1:]), cache.dtype)
            if out is not None:
                return torch.index_select(cache, 0, src, out=out)
        return cache.index_select(0, src)

    def _routes(self, endpoints: Sequence[Endpoint]) -> list[tuple[str, int, int]]:
        """(address, first head, end head) for each decode rank sharing heads with us."""
        self._ranks.update((address, rank) for address, rank, _ in endpoints)
        return self.layout.head_routes(self.tp_rank, self.tp_size, endpoints)

    def finish(self, request_id: str, first: PrefillDone | None, lease_s: float | None = None,
               ticket: bytes = b""):
        """DONE after the request's last layer on every pair it used: rank 0 (which holds
        the target) sends `first` to the decode group's rank 0, every other pair a
        `PartsDone`. `lease_s`, `ticket`: follower ranks' (rank 0 uses its target's).
        Returns the future of the DONE to decode rank 0, if this rank sends it."""
        t = self.targets.pop(request_id, None)
        addresses = self.sent_to.pop(request_id, set())
        primary = next((a for a, r, _ in t.endpoints if r == 0), None) if t else None
        if primary is not None and first is not None:
            addresses.add(primary)
        if t is not None:
            lease_s, ticket = t.lease.left(), t.ticket
        future = None
        parts = kv_messages.encode(PartsDone())
        for address in sorted(addresses):
            body = kv_messages.encode(first) if address == primary and first else parts
            f = self.sender.finish(address, self._wire(request_id, address), body, lease_s,
                                   ticket)
            if address == primary:
                future = f
        return future

    def abort(self, request_id: str, reason: str) -> None:
        t = self.targets.pop(request_id, None)
        addresses = self.sent_to.pop(request_id, set())
        addresses.update(a for a, _, _ in (t.endpoints if t else []))
        self.sent_bytes.pop(request_id, None)
        ticket = t.ticket if t is not None else b""  # a started transfer keeps its own
        for address in addresses:
            self.sender.abort(address, self._wire(request_id, address), reason, ticket)

    def _wire(self, request_id: str, address: str) -> str:
        return wire_request_id(request_id, self.tp_rank, self._ranks.get(address, 0))
