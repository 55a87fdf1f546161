"""Pulling a prompt's prefix from another worker into this decode worker's prefix cache.

The router sets `DecodeRequest.kv_source` when another worker X holds a longer leading prefix
of the prompt than this worker and the rest is short enough to compute here. Before the
request is admitted:

    engine thread: pin own leading blocks [0, c), allocate fresh blocks for [c, m),
                   expect them in the sink (every TP rank)                    (RESERVED)
    X.PushKV(prompt, [c, m), our receivers + fresh blocks) ─► X sends k blocks, DONE{k}
    wait for the sink (bounded by the deadline and PULL_WAIT_S)              (TRANSFERRING)
    engine thread: stop the sink, publish the k blocks that landed under their hashes,
                   release every block (cached-free) and admit the request    (SETTLED)

Any failure (X down, X holds less, a timeout, a transfer error) leaves k = 0: the request is
computed here as if there had been no pull. The engine thread owns `_held`; a reservation is
always settled, in command order, even when the caller is cancelled mid-pull.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import grpc

from decode_worker.kv_sink import DecodeKVSink, ErrorFn, ReadyFn
from decode_worker.tp_follower import ready_key
from pdserve.block_hash import chain_hashes
from pdserve.engine.engine import LLMEngine
from pdserve.proto import worker_pb, worker_pb_grpc
from pdserve.serving.engine_loop import EngineLoop
from pdserve.serving.kv_push import PULL_BLOCKS
from pdserve.serving.security import ClientSecurity

log = logging.getLogger(__name__)
T = TypeVar("T")
PULL_WAIT_S = 5.0  # cap on one pull: past it, recomputing the prefix is the better bet


@dataclass(frozen=True)
class PullReservation:
    """Blocks held for one pull (engine thread)."""

    token_ids: list[int]
    own: list[int]  # our leading blocks [0, start), pinned so they stay findable
    fresh: list[int]  # destination of prompt blocks [start, start + len(fresh))

    @property
    def start(self) -> int:
        return len(self.own)


class KVPuller:
    def __init__(self, loop: EngineLoop, sink: DecodeKVSink,
                 endpoints: Callable[[], list[worker_pb.KVEndpoint]],
                 count: Callable[[str, float], None], follower_store=None,
                 tp_size: int = 1, security: ClientSecurity | None = None) -> None:
        self._loop = loop
        self._sink = sink
        self._endpoints = endpoints  # this worker's KV receivers, one per TP rank
        self._count = count
        self._store = follower_store  # the TP group's store (None without followers)
        self._tp_size = tp_size
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._security = security or ClientSecurity()  # how to call the pushing worker
        self._held: dict[str, PullReservation] = {}  # engine thread only

    async def pull_then(self, rid: str, ids: list[int], source: worker_pb.KVSource,
                        deadline_unix_s: float, admit: Callable[[LLMEngine], T]) -> T:
        """Pull what `source` holds of the prompt, then run `admit` on the engine thread
        right after the pulled blocks are published (nothing can evict them in between)."""
        wait_s = PULL_WAIT_S
        if deadline_unix_s > 0:
            wait_s = min(wait_s, deadline_unix_s - time.time())
        landed = 0
        try:
            if wait_s > 0 and source.address and source.blocks > 0:
                landed = await self._pull(rid, ids, source, wait_s)
        except Exception:  # a pull is an optimisation: never let it fail the request
            log.exception("pulling KV of %s from %s failed", rid, source.address)
            self._count("kv_pull_failures", 1.0)
        except BaseException:  # cancelled: release the reservation, in command order
            self._loop.post(lambda e: self._settle(e, rid, 0))
            raise
        return await self._loop.call(lambda e: (self._settle(e, rid, landed), admit(e))[1])

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

    # -- steps ---------------------------------------------------------------------------
    async def _pull(self, rid: str, ids: list[int], source: worker_pb.KVSource,
                    wait_s: float) -> int:
        end_at = time.monotonic() + wait_s
        aloop = asyncio.get_running_loop()
        landed: asyncio.Future[dict | None] = aloop.create_future()

        def ready(_: str, meta: dict) -> None:  # transfer threads, under the sink's lock
            aloop.call_soon_threadsafe(_resolve, landed, meta)

        def failed(_: str, why: str) -> None:
            log.info("pulled KV of %s failed on arrival: %s", rid, why)
            aloop.call_soon_threadsafe(_resolve, landed, None)

        res = await self._loop.call(
            lambda e: self._reserve(e, rid, ids, int(source.blocks), wait_s, ready, failed))
        if res is None:
            return 0  # nothing to pull: we hold as much, or no block is free
        self._count("kv_pulls", 1.0)
        t0 = time.monotonic()
        try:
            resp = await self._stub(source.address).PushKV(worker_pb.PushKVRequest(
                request_id=rid, prompt_token_ids=ids, start_block=res.start,
                end_block=res.start + len(res.fresh), endpoints=self._endpoints(),
                block_ids=res.fresh, hash_extra=self._loop.engine.scheduler.kv.hash_extra),
                timeout=wait_s)
            meta = None
            if resp.blocks_sent:
                meta = await asyncio.wait_for(asyncio.shield(landed), end_at - time.monotonic())
            k = min(int(meta.get(PULL_BLOCKS, 0)), resp.blocks_sent) if meta else 0
            if k and not await self._followers_ok(rid, end_at - time.monotonic()):
                k = 0
        except (grpc.aio.AioRpcError, TimeoutError) as exc:
            log.info("pulling KV of %s from %s failed: %s", rid, source.address, exc)
            k = 0
        self._count("kv_pulled_blocks", float(k))
        if not k:
            self._count("kv_pull_failures", 1.0)
        else:  # what a pull costs: PushKV call to the last part landed (incl. followers)
            self._count("kv_pull_s", time.monotonic() - t0)
            self._count("kv_pulled_bytes", float(resp.kv_bytes) * k / max(resp.blocks_sent, 1))
        return k

    def _reserve(self, engine: LLMEngine, rid: str, ids: list[int], source_blocks: int,
                 wait_s: float, ready: ReadyFn, failed: ErrorFn) -> PullReservation | None:
        """Engine thread: pin our prefix, allocate the blocks to pull into, expect them."""
        kv = engine.scheduler.kv
        if not kv.pool.enable_caching:
            return None  # pulled blocks could never be found by the request
        limit = min(source_blocks, (len(ids) - 1) // kv.block_size)  # one token to compute
        own = kv.pin_leading(ids, 0, limit)
        fresh = kv.pool.allocate(max(0, min(limit - len(own), kv.pool.num_free))) or []
        if not fresh:
            kv.unpin(own)
            return None
        res = self._held[rid] = PullReservation(ids, own, fresh)
        self._sink.expect(rid, fresh, 0, wait_s, on_ready=ready, on_error=failed)
        if engine.tp_driver is not None:
            engine.tp_driver.call({"op": "expect", "rid": rid, "blocks": fresh, "skip": 0,
                                   "timeout": wait_s})
        return res

    def _settle(self, engine: LLMEngine, rid: str, landed: int) -> None:
        """Engine thread: no KV may land any more; publish the `landed` leading fresh blocks
        and release every block of the reservation (a no-op if there is none)."""
        res = self._held.pop(rid, None)
        if res is None:
            return
        self._sink.cancel(rid)
        if engine.tp_driver is not None:
            engine.tp_driver.call({"op": "cancel", "rid": rid})
            for r in range(1, self._tp_size):
                self._store.delete_key(ready_key(rid, r))
        kv = engine.scheduler.kv
        bs, end = kv.block_size, res.start + landed
        hashes = chain_hashes(res.token_ids[:end * bs], bs, kv.hash_extra)
        for i in range(res.start, end):  # first writer wins: a block computed meanwhile stays
            kv.pool.cache_block(res.fresh[i - res.start], hashes[i],
                                res.token_ids[i * bs:(i + 1) * bs])
        kv.unpin(res.own + res.fresh)

    async def _followers_ok(self, rid: str, wait_s: float) -> bool:
        """With tensor parallelism, every follower rank must have its heads of the blocks."""
        if self._store is None or self._tp_size == 1:
            return True
        keys = [ready_key(rid, r) for r in range(1, self._tp_size)]

        def check() -> bool:
            try:
                self._store.wait(keys, timedelta(seconds=max(wait_s, 0.001)))
                return all(self._store.get(k).decode() == "ok" for k in keys)
            except RuntimeError:
                return False

        return await asyncio.to_thread(check)

    def _stub(self, address: str) -> worker_pb_grpc.WorkerStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = self._security.aio_channel(address)
        return worker_pb_grpc.WorkerStub(channel)


def _resolve(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)
