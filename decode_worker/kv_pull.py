"""Pulling a prompt's prefix from another worker into this decode worker's prefix cache.

The router sets `DecodeRequest.kv_source` when another worker X holds a longer leading prefix
of the request's tokens than this worker: a prompt whose rest is short enough to compute
here, or a migrated request (its prompt on X, its earlier output computed here). The request
joins the engine at once, through the engine's pull API:

    engine thread: reserve_pull ─► PULLING (own prefix pinned, fresh blocks for [c, m)),
                   the sink expects them on every TP rank, under the pull's lease and a
                   fresh ticket
    X.PushKV(tokens, [c, m), our receivers + fresh blocks, ticket) ─► X sends k blocks
                   (every frame tagged under the ticket), PullDone{k}
    wait for the sink, within the lease                                   (TRANSFERRING)
    engine thread: stop the sink, settle_pull(k) ─► the k blocks are published, the rest
                   freed, the request WAITING: its prefill starts after them     (SETTLED)

Any failure (X down, X holds less, the lease running out, a transfer error) settles with
k = 0: the request computes everything here, as if there had been no pull. A cancelled
request is simply aborted (its blocks go with it); a late settle then finds nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import grpc

from decode_worker.kv_sink import DecodeKVSink, Ending
from decode_worker.tp_follower import KVCancel, KVExpect, ready_key
from kv_store.transfer import new_ticket
from pdserve.engine.engine import LLMEngine
from pdserve.engine.remote_kv import PullReservation
from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto import worker_pb, worker_pb_grpc
from pdserve.serving.engine_loop import EngineLoop
from pdserve.serving.kv_lease import Lease
from pdserve.serving.kv_messages import PullDone
from pdserve.serving.security import ClientSecurity

log = logging.getLogger(__name__)


class KVPuller:
    def __init__(self, loop: EngineLoop, sink: DecodeKVSink,
                 endpoints: Callable[[], list[worker_pb.KVEndpoint]],
                 count: Callable[[str, float], None], pull_lease_s: float,
                 follower_store=None, tp_size: int = 1,
                 security: ClientSecurity | None = None) -> None:
        self._loop = loop
        self._sink = sink
        self._endpoints = endpoints  # this worker's KV receivers, one per TP rank
        self._count = count
        self._lease_s = pull_lease_s
        self._store = follower_store  # the TP group's store (None without followers)
        self._tp_size = tp_size
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._security = security or ClientSecurity()  # how to call the pushing worker

    async def add_pulled(self, rid: str, prompt: Sequence[int], params: SamplingParams,
                         seed: int, generated: Sequence[int], source: worker_pb.KVSource,
                         deadline_unix_s: float) -> None:
        """Add the request to the engine, first pulling what `source` holds of it. Raises
        ValueError for a bad request; a failed pull only means computing more."""
        lease = Lease.start(self._lease_s, deadline_unix_s)
        aloop = asyncio.get_running_loop()
        landed: asyncio.Future[Ending | None] = aloop.create_future()

        def ready(_: str, done: Ending | None, __: Lease) -> None:  # under the sink's lock
            aloop.call_soon_threadsafe(_resolve, landed, done)

        def failed(_: str, why: str) -> None:
            log.info("pulled KV of %s failed on arrival: %s", rid, why)
            aloop.call_soon_threadsafe(_resolve, landed, None)

        blocks = int(source.blocks) if source.address and lease.left() > 0 else 0
        ticket = new_ticket()
        res = await self._loop.call(lambda e: self._reserve(
            e, rid, prompt, params, seed, generated, blocks, lease, ticket, ready, failed))
        if res is None:
            return  # nothing to pull (we hold as much, no free block): queued as it is
        self._count("kv_pulls", 1.0)
        k = 0
        try:
            k = await self._transfer(res, source.address, lease, ticket, landed)
        except Exception:  # a pull is an optimisation: never let it fail the request
            log.exception("pulling KV of %s from %s failed", rid, source.address)
        finally:  # also when cancelled: in command order, before anything reuses the blocks
            self._loop.post(lambda e: self._settle(e, rid, k))
        self._count("kv_pulled_blocks", float(k))
        if not k:
            self._count("kv_pull_failures", 1.0)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

    # -- steps ---------------------------------------------------------------------------
    def _reserve(self, engine: LLMEngine, rid, prompt, params, seed, generated,
                 source_blocks: int, lease: Lease, ticket: bytes, ready, failed
                 ) -> PullReservation | None:
        """Engine thread: add the request, reserving the blocks to pull into, and expect
        them under `ticket` on every rank (before any can arrive)."""
        res = engine.reserve_pull(rid, prompt, params, seed, source_blocks, generated)
        if res is None:
            return None
        self._sink.expect(rid, res.block_ids, 0, lease, ticket, PullDone, on_ready=ready,
                          on_error=failed)
        if engine.tp_driver is not None:
            engine.tp_driver.call(KVExpect(rid, res.block_ids, 0, lease.left(), ticket,
                                           pull=True).to_wire())
        return res

    async def _transfer(self, res: PullReservation, address: str, lease: Lease,
                        ticket: bytes, landed: asyncio.Future[Ending | None]) -> int:
        """PushKV to the source (handing it the ticket, over the authenticated call), then
        wait for the blocks it sent to land: how many did."""
        t0 = time.monotonic()
        try:
            resp = await self._stub(address).PushKV(worker_pb.PushKVRequest(
                request_id=res.request_id, prompt_token_ids=res.token_ids,
                start_block=res.start_block, end_block=res.end_block,
                endpoints=self._endpoints(), block_ids=res.block_ids,
                hash_extra=self._loop.engine.hash_extra, kv_ticket=ticket),
                timeout=max(lease.left(), 0.001))
            if not resp.blocks_sent:
                return 0
            done = await asyncio.wait_for(asyncio.shield(landed), lease.left())
            k = min(done.blocks, resp.blocks_sent) if isinstance(done, PullDone) else 0
            if k and not await self._followers_ok(res.request_id, lease):
                k = 0
        except (grpc.aio.AioRpcError, TimeoutError) as exc:
            log.info("pulling KV of %s from %s failed: %s", res.request_id, address, exc)
            return 0
        if k:  # what a pull costs: PushKV call to the last part landed (incl. followers)
            self._count("kv_pull_s", time.monotonic() - t0)
            self._count("kv_pulled_bytes", float(resp.kv_bytes) * k / max(resp.blocks_sent, 1))
        return k

    def _settle(self, engine: LLMEngine, rid: str, landed: int) -> None:
        """Engine thread: no KV may land any more; keep the `landed` blocks (a no-op if the
        request was aborted meanwhile)."""
        self._sink.cancel(rid)
        if engine.tp_driver is not None:
            if engine.has_request(rid):
                engine.tp_driver.call(KVCancel(rid).to_wire())
            for r in range(1, self._tp_size):
                self._store.delete_key(ready_key(rid, r))
        engine.settle_pull(rid, landed)

    async def _followers_ok(self, rid: str, lease: Lease) -> bool:
        """With tensor parallelism, every follower rank must have its heads of the blocks."""
        if self._store is None or self._tp_size == 1:
            return True
        keys = [ready_key(rid, r) for r in range(1, self._tp_size)]

        def check() -> bool:
            try:
                self._store.wait(keys, timedelta(seconds=max(lease.left(), 0.001)))
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
