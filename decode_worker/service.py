"""The decode worker's gRPC service: decode-first handshake, KV intake, token streaming.

A disaggregated request's life on this worker (all of it through the engine's remote-KV API,
`pdserve.engine.remote_kv`):

    Decode() ─► reserve_remote (prefix hit counted), a fresh ticket ─► `ready`
       {cached_blocks, block_ids, endpoints, kv_lease_s, kv_ticket}
       WAITING_FOR_KV ── every part landed + PrefillDone{first token} ──► activate_remote
                     │      ──► RUNNING ──► tokens ... ──► finished
                     └── transfer failed / lease ran out ──► fail_remote ──► ABORTED
                         (the router moves the request to another decode worker)

With `local_prefill` the request skips the transfer and is prefilled here; with `kv_source`
too, it first pulls the prefix from the worker that holds it (`kv_pull`). A migrated request
brings `generated_token_ids` (what the client already has) and continues after them. With
`n` > 1 the engine forks choices 1..n-1 (ids "<id>.c<j>") from the request once its prompt's
KV is in; one stream carries every choice's events, tagged with their index, and ends after
the last one's `finished`.

The ticket binds the transfer to this hand-off: only frames tagged under it land in the
reserved blocks (`kv_store.transfer.auth`), and it leaves this worker only in `ready`, on the
authenticated Decode stream (the router hands it to the prefill worker in `Prefill`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from datetime import timedelta

import grpc

from decode_worker.kv_pull import KVPuller
from decode_worker.kv_sink import DecodeKVSink, Ending
from decode_worker.tp_follower import KVCancel, KVExpect, endpoint_key, nixl_key, ready_key
from kv_store.transfer import new_ticket
from pdserve.engine.engine import LLMEngine
from pdserve.engine.finish import FinishReason
from pdserve.engine.outputs import StepOutput
from pdserve.engine.remote_kv import NoKVCapacity
from pdserve.engine.sampler import choice_seed
from pdserve.proto import worker_pb
from pdserve.serving.convert import finish_to_pb, logprobs_to_pb, params_from_pb
from pdserve.serving.engine_loop import EngineLoop
from pdserve.serving.kv_lease import Lease
from pdserve.serving.kv_messages import PrefillDone
from pdserve.serving.worker_base import WorkerServicerBase
from pdserve.serving.worker_options import WorkerOptions

log = logging.getLogger(__name__)


class DecodeService(WorkerServicerBase):
    def __init__(self, options: WorkerOptions, loop: EngineLoop, recorder=None) -> None:
        super().__init__(options, loop, recorder)
        self.sink = DecodeKVSink(loop.engine.kv_caches, self._kv_ready, self._kv_failed)
        self._failed: dict[str, str] = {}
        driver = loop.engine.tp_driver
        self.tp_size = loop.engine.tp.size
        self.follower_store = driver.group.store if driver is not None else None
        self.puller = KVPuller(loop, self.sink, lambda: self.endpoints, self.count,
                               options.lease.pull_lease_s, self.follower_store, self.tp_size,
                               options.security.client)
        self.kv_receiver = None  # rank 0's KVReceiver, set by the entry point

    def transfer_counters(self) -> dict[str, float]:
        """What rank 0's receiver refused — pair offers (bad signature, foreign version, no
        room) and frames not tagged under their transfer's ticket — and the KV bytes it took
        in: in all, through NIXL, and of those read from the sender's staging slots."""
        if self.kv_receiver is None:
            return {}
        s = self.kv_receiver.stats()
        return {"kv_pairs_refused": float(s["pairs_refused"]),
                "kv_frames_refused": float(s["frames_refused"]),
                "kv_bytes_received": float(s["bytes_received"]),
                "kv_bytes_received_nixl": float(s["bytes_received_nixl"]),
                "kv_bytes_read_nixl": float(s["bytes_read_nixl"])}

    def follower_endpoints(self, timeout_s: float = 120.0) -> list[worker_pb.KVEndpoint]:
        """The KV receivers of follower ranks, with their NIXL landing pools (they publish
        both in the group's store)."""
        if self.follower_store is None:
            return []
        ranks = range(1, self.tp_size)
        keys = [endpoint_key(r) for r in ranks] + [nixl_key(r) for r in ranks]
        self.follower_store.wait(keys, timedelta(seconds=timeout_s))
        return [worker_pb.KVEndpoint(address=self.follower_store.get(endpoint_key(r)).decode(),
                                     tp_rank=r, tp_size=self.tp_size,
                                     nixl=self.follower_store.get(nixl_key(r)))
                for r in ranks]

    # -- RPCs ----------------------------------------------------------------------------
    async def Decode(self, request, context):
        rid = request.request_id
        try:
            params = params_from_pb(request.sampling)
            # Off the engine thread and the event loop; the engine then hits the cache.
            await asyncio.to_thread(self.loop.engine.compile_grammar, params)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        forks = [(f"{rid}.c{j}", choice_seed(request.seed, j)) for j in range(1, request.n)]
        index = {rid: 0, **{child: j for j, (child, _) in enumerate(forks, 1)}}
        stream = self.loop.open_stream(rid, *(child for child, _ in forks))
        running = set(index)
        try:
            ready, over = await self._admit(request, rid, params, forks, context)
            yield worker_pb.DecodeEvent(ready=ready)
            if over is not None:  # a continuation whose earlier output already ended it
                running.clear()
                yield self._finished(StepOutput(rid, [], [], over, len(request.prompt_token_ids),
                                                0, len(request.generated_token_ids)))
                return
            while running:
                out: StepOutput = await stream.get()
                i = index.get(out.request_id)
                if i is None or out.request_id not in running:
                    continue
                if out.new_token_ids:
                    yield worker_pb.DecodeEvent(tokens=worker_pb.TokenBatch(
                        token_ids=out.new_token_ids, logprobs=logprobs_to_pb(out.new_logprobs),
                        prompt_logprobs=logprobs_to_pb(out.prompt_logprobs or []), index=i))
                if out.finished:
                    running.discard(out.request_id)
                    await self._check_end(out.request_id, context)
                    yield self._finished(out, i)
        finally:
            self.loop.close_stream(rid, *(child for child, _ in forks))
            self._failed.pop(rid, None)
            for left in running:
                await self._abort(left)

    async def Abort(self, request, context):
        found = await self._abort(request.request_id)
        if found:  # its Decode stream (one choice of a forked request, say) learns it ended
            self.loop.push_finished(request.request_id, FinishReason.ABORT)
        return worker_pb.AbortResponse(found=found)

    def _finished(self, out: StepOutput, index: int = 0) -> worker_pb.DecodeEvent:
        return worker_pb.DecodeEvent(finished=worker_pb.DecodeFinished(
            reason=finish_to_pb(out.finish_reason), prompt_tokens=out.num_prompt_tokens,
            completion_tokens=out.num_output_tokens, cached_tokens=out.num_cached_tokens,
            index=index))

    async def _check_end(self, rid: str, context) -> None:
        """A request that ended because its hand-off failed, or because the engine died, is
        never reported as a normal end."""
        error = self._failed.pop(rid, None)
        if error is None and not self.loop.alive:
            # The engine died (e.g. a tensor-parallel rank is gone).
            await context.abort(grpc.StatusCode.UNAVAILABLE, "decode worker's engine stopped")
        if error is not None:
            # ABORTED, not UNAVAILABLE: this worker is fine, the request is not.
            await context.abort(grpc.StatusCode.ABORTED, error)

    # -- admission -----------------------------------------------------------------------
    async def _admit(self, request, rid, params, forks, context
                     ) -> tuple[worker_pb.DecodeReady, FinishReason | None]:
        """Reserve or add the request (and its forks); the `ready` event, and the finish
        reason of a continuation that has nothing left to generate."""
        ids, generated = list(request.prompt_token_ids), list(request.generated_token_ids)
        try:
            if generated and not request.local_prefill:
                raise ValueError("generated_token_ids needs local_prefill (a continuation is "
                                 "computed by the decode worker)")
            if forks and (generated or request.HasField("kv_source")):
                raise ValueError("n > 1 cannot continue earlier output or pull a prefix")
            if request.local_prefill:
                over = await self._add_local(request, rid, ids, params, generated, forks)
                self.count("local_prefills")
                return worker_pb.DecodeReady(), over
            lease = Lease.start(self.options.lease.kv_lease_s, request.deadline_unix_s)
            ticket = new_ticket()
            res = await self.loop.call(
                lambda e: self._reserve(e, rid, ids, params, request.seed, lease, ticket, forks))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except NoKVCapacity as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"decode worker: {exc}")
        except RuntimeError as exc:  # the engine (or a tensor-parallel rank) is broken
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"decode engine failed: {exc}")
        self.count("remote_prefills")
        self.count("prefix_hit_blocks", res.cached_blocks)
        return worker_pb.DecodeReady(cached_blocks=res.cached_blocks, block_ids=res.block_ids,
                                     endpoints=self.endpoints, kv_lease_s=lease.left(),
                                     kv_ticket=ticket), None

    async def _add_local(self, request, rid, ids, params, generated, forks=()
                         ) -> FinishReason | None:
        """Add a request prefilled here, after pulling its prefix when the router says
        another worker holds it. A continuation is checked against its earlier output."""
        engine = self.loop.engine  # validate / continuation_finished read fixed limits only
        engine.validate(ids, params, generated)
        if generated:
            self.count("continuations")
            over = engine.continuation_finished(len(ids), params, generated)
            if over is not None:
                return over
        if request.HasField("kv_source"):
            await self.puller.add_pulled(rid, ids, params, request.seed, generated,
                                         request.kv_source, request.deadline_unix_s)
        else:
            await self.loop.call(lambda e: e.add_request(rid, ids, params, request.seed,
                                                         generated, forks))
        return None

    def _reserve(self, engine: LLMEngine, rid, ids, params, seed, lease: Lease,
                 ticket: bytes, forks=()):
        """Engine thread: hold the prompt's blocks and expect their KV, under `ticket`, on
        every rank, before the router (and so the prefill worker) learns where to send it."""
        res = engine.reserve_remote(rid, ids, params, seed, forks)
        self.sink.expect(rid, res.block_ids, res.cached_blocks, lease, ticket)
        if engine.tp_driver is not None:
            engine.tp_driver.call(KVExpect(rid, res.block_ids, res.cached_blocks,
                                           lease.left(), ticket).to_wire())
        return res

    async def _abort(self, rid: str) -> bool:
        self.sink.cancel(rid)  # first: no KV write may land after the blocks are freed
        try:
            return await self.loop.call(lambda e: self._release(e, rid))
        except RuntimeError:
            return False  # a broken engine has nothing left to release

    def _release(self, engine: LLMEngine, rid: str) -> bool:
        """End a request on the engine thread; follower ranks drop it first."""
        if engine.tp_driver is not None and engine.has_request(rid):
            engine.tp_driver.call(KVCancel(rid).to_wire())
        return engine.abort(rid)

    # -- KV callbacks (transfer threads, under the sink's lock) ----------------------------
    def _kv_ready(self, rid: str, done: Ending | None, lease: Lease) -> None:
        if not isinstance(done, PrefillDone):
            self._kv_failed(rid, f"a remote prefill ended with {done!r}")
            return
        if done.sampled_at > 0:
            # Time the request waited for KV after the prefill finished: the exposed transfer.
            self.count("kv_exposed_s", max(0.0, time.time() - done.sampled_at))
        self.count("kv_transfers")
        if self.follower_store is None:
            self.loop.post(lambda e: self._activate(e, rid, done.token_id))
            return
        threading.Thread(target=self._await_followers, args=(rid, done.token_id, lease),
                         daemon=True).start()

    def _await_followers(self, rid: str, token: int, lease: Lease) -> None:
        """Rank 0 has its heads; wait for every follower rank's (tensor parallelism)."""
        keys = [ready_key(rid, r) for r in range(1, self.tp_size)]
        try:
            self.follower_store.wait(keys, timedelta(seconds=max(lease.left(), 0.001)))
            states = [self.follower_store.get(k).decode() for k in keys]
        except RuntimeError as exc:
            states = [f"fail: {exc}"]
        for k in keys:
            self.follower_store.delete_key(k)
        bad = [s for s in states if s != "ok"]
        if bad:
            self._kv_failed(rid, f"a decode rank failed: {bad[0]}")
        else:
            self.loop.post(lambda e: self._activate(e, rid, token))

    def _kv_failed(self, rid: str, reason: str) -> None:
        def fail(engine: LLMEngine) -> None:
            if engine.tp_driver is not None and engine.has_request(rid):
                engine.tp_driver.call(KVCancel(rid).to_wire())
            out = engine.fail_remote(rid)
            if out is not None:
                self._failed[rid] = f"KV transfer failed: {reason}"
                self.loop.emit([out])
        self.loop.post(fail)

    def _activate(self, engine: LLMEngine, rid: str, first_token: int) -> None:
        """All KV is in: the request joins the running batch with P's first token."""
        out = engine.activate_remote(rid, first_token)
        if out is not None:  # that token ended it
            self.loop.emit([out])


async def expire_loop(service: DecodeService, period_s: float = 0.25) -> None:
    while True:
        await asyncio.sleep(period_s)
        service.sink.expire()
