"""The decode worker's gRPC service: decode-first handshake, KV intake, token streaming.

A disaggregated request's life on this worker:

    Decode() ─► reserve blocks (prefix hit counted) ─► `ready` event {cached_blocks, block_ids}
       WAITING_FOR_KV ── all layers + DONE{first token} ──► RUNNING ──► tokens ... ► finished
                     └── transfer failed / timed out ──► ABORTED (router: UNAVAILABLE)

With `local_prefill` the request skips the transfer and is prefilled here; with `kv_source`
too, it first pulls the prompt's prefix from the worker that holds it (`kv_pull`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from datetime import timedelta

import grpc

from decode_worker.kv_pull import KVPuller
from decode_worker.kv_sink import DecodeKVSink
from decode_worker.tp_follower import endpoint_key, ready_key
from pdserve.engine.engine import LLMEngine
from pdserve.engine.outputs import StepOutput
from pdserve.engine.request import RequestStatus
from pdserve.engine.stop import apply_stop_rules
from pdserve.proto import worker_pb
from pdserve.serving.convert import FINISH_TO_PB, logprobs_to_pb, params_from_pb
from pdserve.serving.engine_loop import EngineLoop
from pdserve.serving.worker_base import WorkerServicerBase
from pdserve.serving.worker_options import WorkerOptions

log = logging.getLogger(__name__)
KV_TIMEOUT_S = 60.0


class NoCapacity(Exception):
    """Not enough free KV blocks to reserve the request's prompt."""


class DecodeService(WorkerServicerBase):
    def __init__(self, options: WorkerOptions, loop: EngineLoop, recorder=None) -> None:
        super().__init__(options, loop, recorder)
        self.sink = DecodeKVSink(loop.engine.runner.caches, self._kv_ready, self._kv_failed)
        self._failed: dict[str, str] = {}
        driver = loop.engine.tp_driver
        self.tp_size = loop.engine.tp.size
        self.follower_store = driver.group.store if driver is not None else None
        self.puller = KVPuller(loop, self.sink, lambda: self.endpoints, self.count,
                               self.follower_store, self.tp_size, options.security.client)

    def follower_endpoints(self, timeout_s: float = 120.0) -> list[worker_pb.KVEndpoint]:
        """The KV receivers of follower ranks (they publish them in the group's store)."""
        if self.follower_store is None:
            return []
        keys = [endpoint_key(r) for r in range(1, self.tp_size)]
        self.follower_store.wait(keys, timedelta(seconds=timeout_s))
        return [worker_pb.KVEndpoint(address=self.follower_store.get(k).decode(), tp_rank=r,
                                     tp_size=self.tp_size) for r, k in enumerate(keys, 1)]

    # -- RPCs ----------------------------------------------------------------------------
    async def Decode(self, request, context):
        rid = request.request_id
        try:
            params = params_from_pb(request.sampling)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        ids = list(request.prompt_token_ids)
        stream = self.loop.open_stream(rid)
        finished = False
        try:
            ready = await self._admit(request, rid, ids, params, context)
            yield worker_pb.DecodeEvent(ready=ready)
            while True:
                out: StepOutput = await stream.get()
                if out.new_token_ids:
                    yield worker_pb.DecodeEvent(tokens=worker_pb.TokenBatch(
                        token_ids=out.new_token_ids, logprobs=logprobs_to_pb(out.new_logprobs)))
                if out.finished:
                    finished = True
                    error = self._failed.pop(rid, None)
                    if error is None and not self.loop.alive:
                        # The engine died (e.g. a tensor-parallel rank is gone): never
                        # report that as a normal end of the request.
                        await context.abort(grpc.StatusCode.UNAVAILABLE,
                                            "decode worker's engine stopped")
                    if error is not None:
                        # ABORTED, not UNAVAILABLE: this worker is fine, the request is not.
                        await context.abort(grpc.StatusCode.ABORTED, error)
                    yield worker_pb.DecodeEvent(finished=worker_pb.DecodeFinished(
                        reason=FINISH_TO_PB[out.finish_reason],
                        prompt_tokens=out.num_prompt_tokens,
                        completion_tokens=out.num_output_tokens,
                        cached_tokens=out.num_cached_tokens))
                    return
        finally:
            self.loop.close_stream(rid)
            self._failed.pop(rid, None)
            if not finished:
                await self._abort(rid)

    async def Abort(self, request, context):
        return worker_pb.AbortResponse(found=await self._abort(request.request_id))

    # -- admission -----------------------------------------------------------------------
    async def _admit(self, request, rid, ids, params, context):
        seed = request.seed
        try:
            if request.local_prefill:
                await self._add_local(request, rid, ids, params)
                self.count("local_prefills")
                return worker_pb.DecodeReady()
            cached, blocks = await self.loop.call(
                lambda e: self._reserve(e, rid, ids, params, seed))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except NoCapacity as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except RuntimeError as exc:  # the engine (or a tensor-parallel rank) is broken
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"decode engine failed: {exc}")
        self.sink.expect(rid, blocks, cached, KV_TIMEOUT_S)
        self.count("remote_prefills")
        self.count("prefix_hit_blocks", cached)
        return worker_pb.DecodeReady(cached_blocks=cached, block_ids=blocks,
                                     endpoints=self.endpoints)

    async def _add_local(self, request, rid, ids, params) -> None:
        """Admit a request prefilled here, after pulling its prefix when the router says
        another worker holds it."""
        def add(e: LLMEngine) -> None:
            e.add_request(rid, ids, params, request.seed)

        if not request.HasField("kv_source"):
            await self.loop.call(add)
            return
        self.loop.engine.validate(ids, params)  # reads fixed limits only: any thread
        await self.puller.pull_then(rid, ids, request.kv_source, request.deadline_unix_s, add)

    async def _abort(self, rid: str) -> bool:
        self.sink.cancel(rid)  # first: no KV write may land after the blocks are freed
        try:
            return await self.loop.call(lambda e: self._release(e, rid))
        except RuntimeError:
            return False  # a broken engine has nothing left to release

    def _release(self, engine: LLMEngine, rid: str) -> bool:
        """End a request on the engine thread; follower ranks drop it first."""
        if engine.tp_driver is not None and rid in engine.scheduler.requests:
            engine.tp_driver.call({"op": "cancel", "rid": rid})
        return engine.abort(rid)

    def _reserve(self, engine: LLMEngine, rid, ids, params, seed) -> tuple[int, list[int]]:
        cached, blocks = _reserve(engine, rid, ids, params, seed)
        if engine.tp_driver is not None:
            engine.tp_driver.call({"op": "expect", "rid": rid, "blocks": blocks,
                                   "skip": cached, "timeout": KV_TIMEOUT_S})
        return cached, blocks

    # -- KV callbacks (transfer threads) --------------------------------------------------
    def _kv_ready(self, rid: str, meta: dict) -> None:
        if isinstance(meta.get("t_done"), float):
            # Time the request waited for KV after the prefill finished: the exposed transfer.
            self.count("kv_exposed_s", max(0.0, time.time() - meta["t_done"]))
            self.count("kv_transfers")
        token = int(meta["token_id"])
        if self.follower_store is None:
            self.loop.post(lambda e: self._activate(e, rid, token))
            return
        threading.Thread(target=self._await_followers, args=(rid, token), daemon=True).start()

    def _await_followers(self, rid: str, token: int) -> None:
        """Rank 0 has its heads; wait for every follower rank's (tensor parallelism)."""
        keys = [ready_key(rid, r) for r in range(1, self.tp_size)]
        try:
            self.follower_store.wait(keys, timedelta(seconds=KV_TIMEOUT_S))
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
            if engine.tp_driver is not None and rid in engine.scheduler.requests:
                engine.tp_driver.call({"op": "cancel", "rid": rid})
            req = engine.scheduler.finish(rid, RequestStatus.FINISHED_ABORTED)
            if req is not None:
                self._failed[rid] = f"KV transfer failed: {reason}"
                self.loop.emit([StepOutput(rid, [], [], "abort", req.num_prompt_tokens, 0, 0)])
        self.loop.post(fail)

    def _activate(self, engine: LLMEngine, rid: str, first_token: int) -> None:
        """All KV is in: the request joins the running batch with P's first token."""
        req = engine.scheduler.requests.get(rid)
        if req is None or req.status is not RequestStatus.WAITING_FOR_KV:
            return
        req.num_computed_tokens = req.num_prompt_tokens
        _, reason = apply_stop_rules(req, [first_token], engine.eos_token_ids,
                                     engine.max_model_len)
        req.output_token_ids.append(first_token)
        engine.scheduler.kv.publish(req)
        if reason is None:
            engine.scheduler.activate(req)
            return
        engine.scheduler.finish(rid, RequestStatus(reason))
        self.loop.emit([StepOutput(rid, [], [], reason, req.num_prompt_tokens,
                                   max(req.num_cached_tokens, 0), 1)])


def _reserve(engine: LLMEngine, rid: str, ids: list[int], params, seed: int
             ) -> tuple[int, list[int]]:
    """Hold blocks for the whole prompt; returns (leading blocks already cached, block ids)."""
    req = engine.add_request(rid, ids, params, seed, status=RequestStatus.WAITING_FOR_KV)
    kv = engine.scheduler.kv
    hits = kv.match_prefix(req)
    if not kv.admit(req, hits, len(ids) - len(hits) * kv.block_size):
        engine.scheduler.finish(rid, RequestStatus.FINISHED_ABORTED)
        raise NoCapacity(f"decode worker has {kv.pool.num_free} free KV blocks; "
                         f"the prompt needs {-(-len(ids) // kv.block_size)}")
    req.num_cached_tokens = req.num_computed_tokens
    return len(hits), list(req.block_ids)


async def expire_loop(service: DecodeService, period_s: float = 0.5) -> None:
    while True:
        await asyncio.sleep(period_s)
        service.sink.expire()
