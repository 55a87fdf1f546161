"""The pushing side of a KV pull: a worker sends prompt blocks it holds to a decode worker.

A decode worker D that the router sends a prompt whose longer prefix lives on this worker X
(prefill or decode role) reserves fresh blocks and calls `PushKV` here:

    PushKV{prompt, blocks [start, end), D's receivers and block ids, the pull's ticket}
      ─► check the request (fields, same block hash `extra`: same model, KV dtype, block size)
      ─► engine thread: pin the run of blocks from `start` that X really holds (hash and token
         ids; host/SSD blocks are loaded into fresh device blocks), copy each layer's blocks
         per receiving rank (its KV heads), unpin
      ─► KVSender: every layer to every D rank, then a `PullDone{n}` to each, all within
         the pull's lease (what is left of the call's deadline: D's lease) and tagged under
         the ticket (D drops any frame that is not)
      ─► {blocks_sent: n, kv_bytes}

Holding nothing is not an error (n = 0, nothing is sent); D then recomputes. Pins never
outlive the engine-thread call, so a push that fails or is cancelled leaks no block here.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import torch

from kv_store.tp_layout import wire_request_id
from kv_store.transfer import TransferError
from kv_store.transfer.auth import TICKET_BYTES
from kv_store.transfer.nixl_path import NixlDescriptor
from pdserve.serving import kv_messages
from pdserve.serving.kv_messages import PullDone

if TYPE_CHECKING:
    from pdserve.engine.engine import LLMEngine
    from pdserve.serving.engine_loop import EngineLoop


class PushError(Exception):
    """Ends a PushKV call with a gRPC status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Route:
    """What goes to one receiving rank: KV heads [lo, hi) under its own wire id (an MLA
    latent: head 0, to every rank)."""

    address: str
    wire_id: str
    lo: int
    hi: int


@dataclass(frozen=True)
class PushPlan:
    """A checked PushKV request."""

    request_id: str
    token_ids: list[int]
    start: int  # first prompt block to send
    end: int  # one past the last
    dst: list[int]  # D's block for each block of [start, end)
    routes: list[Route]
    ticket: bytes  # D's ticket for this pull: tags every frame


def plan_push(request, engine: LLMEngine) -> PushPlan:
    """Check a PushKVRequest against this worker; `PushError` names what is wrong."""
    bad = grpc.StatusCode.INVALID_ARGUMENT
    if not request.request_id:
        raise PushError(bad, "request_id must not be empty")
    bs, ids = engine.config.block_size, list(request.prompt_token_ids)
    start, end = int(request.start_block), int(request.end_block)
    if not start < end or end * bs > len(ids):
        raise PushError(bad, f"start_block={start} and end_block={end} must satisfy start < "
                             f"end <= full blocks of prompt_token_ids ({len(ids) // bs})")
    if len(request.block_ids) != end - start:
        raise PushError(bad, f"block_ids has {len(request.block_ids)} entries; the range "
                             f"has {end - start} blocks")
    receivers = [(e.address, int(e.tp_rank), int(e.tp_size)) for e in request.endpoints]
    if not receivers or any(not a or not 0 <= r < s for a, r, s in receivers):
        raise PushError(bad, "endpoints must be non-empty, each with an address and "
                             "0 <= tp_rank < tp_size")
    if len(request.kv_ticket) != TICKET_BYTES:
        raise PushError(bad, f"kv_ticket must be the decode worker's {TICKET_BYTES}-byte "
                             f"ticket for this pull, got {len(request.kv_ticket)} bytes")
    if request.hash_extra != engine.hash_extra:
        raise PushError(grpc.StatusCode.FAILED_PRECONDITION,
                        "hash_extra differs: this worker's KV blocks are not the caller's "
                        "(model, KV dtype or block size)")
    try:
        for e in request.endpoints:
            if e.nixl:
                NixlDescriptor.decode(e.nixl)
    except ValueError as exc:
        raise PushError(bad, f"endpoints: {exc}") from None
    if engine.tp.size != 1:
        raise PushError(grpc.StatusCode.FAILED_PRECONDITION,
                        "pushing KV from a tensor-parallel worker is not supported yet")
    rank_of = {a: r for a, r, _ in receivers}
    routes = [Route(a, wire_request_id(request.request_id, 0, rank_of[a]), lo, hi)
              for a, lo, hi in engine.kv_layout.head_routes(0, 1, receivers)]
    return PushPlan(request.request_id, ids, start, end, list(request.block_ids), routes,
                    bytes(request.kv_ticket))


def copy_blocks(engine: LLMEngine, plan: PushPlan) -> tuple[int, list[list[torch.Tensor]]]:
    """Engine thread: how many blocks of the range this worker holds, and per route per
    layer a copy of their KV heads (pinned only while copying)."""
    blocks = engine.pin_leading(plan.token_ids, plan.start, plan.end)
    try:
        if not blocks:
            return 0, []
        caches = engine.kv_caches
        src = torch.tensor(blocks, dtype=torch.int64, device=caches[0].device)
        layers = [cache.index_select(0, src) for cache in caches]  # copies: blocks may move
        return len(blocks), [[layer[:, :, r.lo:r.hi].contiguous() for layer in layers]
                             for r in plan.routes]
    finally:
        engine.unpin(blocks)


async def push_kv(loop: EngineLoop, sender, request, lease_s: float | None
                  ) -> tuple[int, int]:
    """Serve one PushKV: returns (blocks sent, bytes sent) once every DONE is on the wire.
    `lease_s`: the pull's lease (None: the sender's default cap), which every send carries."""
    if sender is None:
        raise PushError(grpc.StatusCode.UNIMPLEMENTED, "this worker has no KV sender")
    if not loop.alive:
        raise PushError(grpc.StatusCode.UNAVAILABLE, "engine loop is not running")
    plan = plan_push(request, loop.engine)
    for e in request.endpoints:  # their NIXL landing pools (b"": gloo to that rank)
        sender.add_peer(e.address, bytes(e.nixl))
    n, copies = await loop.call(lambda e: copy_blocks(e, plan))
    if n == 0:
        return 0, 0
    nbytes = 0
    try:
        for route, layers in zip(plan.routes, copies, strict=True):
            for layer, kv in enumerate(layers):
                sender.send_layer(route.address, route.wire_id, layer, plan.dst[:n], kv,
                                  head_start=route.lo, lease_s=lease_s, ticket=plan.ticket)
                nbytes += kv.numel() * kv.element_size()
        body = kv_messages.encode(PullDone(n))
        futures = [asyncio.wrap_future(sender.finish(r.address, r.wire_id, body, lease_s,
                                                     plan.ticket))
                   for r in plan.routes]
        # asyncio.wait never cancels them; the sender settles each by its lease at the latest.
        done, late = await asyncio.wait(futures, timeout=lease_s)
        if late:
            raise TimeoutError(f"{len(late)} DONE marker(s) not sent within the lease")
        for f in done:
            f.result()  # raises the TransferError of a failed route
    except BaseException as exc:
        for r in plan.routes:  # the receiver drops what it got; nothing is pinned here
            sender.abort(r.address, r.wire_id, f"push failed: {exc!r}", plan.ticket)
        if isinstance(exc, TransferError | ValueError | TimeoutError):
            raise PushError(grpc.StatusCode.ABORTED, f"sending KV failed: {exc}") from None
        raise
    return n, nbytes
