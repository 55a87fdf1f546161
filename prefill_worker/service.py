"""The prefill worker's gRPC service.

    Prefill() ─► engine (max_tokens=1, chunked with other prefills) ─► each layer's new KV
    streamed to the decode worker ─► first token sampled ─► PrefillDone{token} to the decode
                                                           worker └► PrefillResponse to the router

The response does not wait for the transfer to finish: the router streams the first token to
the client at once (TTFT), while the decode worker waits for the KV. The transfer runs on the
decode worker's lease (`KVTarget.lease_s`), and every frame is tagged under its ticket
(`KVTarget.kv_ticket`): without the ticket the decode worker accepts none of it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import grpc

from kv_store.transfer.auth import TICKET_BYTES
from pdserve.engine.engine import LLMEngine
from pdserve.engine.outputs import StepOutput
from pdserve.proto import worker_pb
from pdserve.serving.convert import logprob_to_pb, logprobs_to_pb, params_from_pb
from pdserve.serving.engine_loop import EngineLoop
from pdserve.serving.kv_lease import Lease
from pdserve.serving.kv_messages import PrefillDone
from pdserve.serving.worker_base import WorkerServicerBase
from pdserve.serving.worker_options import WorkerOptions
from prefill_worker.kv_streamer import KVStreamer

log = logging.getLogger(__name__)


class PrefillService(WorkerServicerBase):
    def __init__(self, options: WorkerOptions, loop: EngineLoop, streamer: KVStreamer,
                 recorder=None) -> None:
        super().__init__(options, loop, recorder)
        self.streamer = streamer
        # perf_counter marks per request: arrival, first scheduled, first token (TTFT parts).
        self._marks: dict[str, list[float]] = {}

    def step(self, engine: LLMEngine) -> list[StepOutput]:
        """One engine step with per-layer KV streaming (runs on the engine thread)."""
        plan = engine.plan()
        if plan.is_empty:
            return []
        sends = self.streamer.plan_sends(plan)
        t0 = time.perf_counter()
        for chunk in plan.chunks:
            marks = self._marks.get(chunk.request_id)
            if marks is not None and len(marks) == 1:
                marks.append(t0)
        extra = {"sends": [s.to_wire() for s in sends]} if engine.tp_driver else None
        sampled, logprobs = engine.execute(plan, self.streamer.layer_hook(sends), extra)
        t1 = time.perf_counter()
        self.count("step_compute_s", t1 - t0)
        outputs = engine.apply_results(plan, sampled, logprobs)
        for out in outputs:
            if out.finished and out.new_token_ids:
                self._marks.get(out.request_id, []).append(t1)
                lp = out.new_logprobs[0]
                # sampled_at (wall clock) lets the decode worker measure the exposed transfer.
                first = PrefillDone(out.new_token_ids[0], None if lp is None else lp.logprob,
                                    time.time())
                future = self.streamer.finish(out.request_id, first)
                if future is not None:
                    future.add_done_callback(self._transfer_done)
        return outputs

    def _transfer_done(self, future) -> None:
        """Transfer statistics (runs on a sender thread)."""
        if future.exception() is not None:
            self.count("kv_transfers_failed")
            return
        result = future.result()
        self.count("kv_transfers_done")
        self.count("kv_bytes", result.bytes_sent)
        self.count("kv_transfer_s", result.latency_s)

    async def Prefill(self, request, context):
        rid = request.request_id
        try:
            params = params_from_pb(request.sampling)
            # Only the first token is sampled here; min_tokens still masks EOS at step 0.
            first = dataclasses.replace(params, max_tokens=1,
                                        min_tokens=min(params.min_tokens, 1), stop=())
            # Off the engine thread and the event loop; the engine then hits the cache.
            await asyncio.to_thread(self.loop.engine.compile_grammar, first)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        target = request.target
        if not target.endpoints or len(target.block_ids) * self._block_size() < len(
                request.prompt_token_ids):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "target must name a KV endpoint and a block per prompt block")
        if len(target.kv_ticket) != TICKET_BYTES:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"target.kv_ticket must be the decode worker's "
                                f"{TICKET_BYTES}-byte ticket (DecodeReady.kv_ticket)")
        ids = list(request.prompt_token_ids)
        lease = Lease.start(target.lease_s or self.options.lease.kv_lease_s)
        stream = self.loop.open_stream(rid)
        self._marks[rid] = [time.perf_counter()]
        done = False
        try:
            def admit(engine: LLMEngine) -> None:
                engine.add_request(rid, ids, first, request.seed)
                endpoints = [(e.address, e.tp_rank, max(e.tp_size, 1))
                             for e in target.endpoints]
                peers = tuple((e.address, bytes(e.nixl)) for e in target.endpoints)
                self.streamer.add(rid, endpoints, list(target.block_ids), target.skip_blocks,
                                  lease, bytes(target.kv_ticket), peers)
            try:
                await self.loop.call(admit)
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except RuntimeError as exc:  # the engine (or a tensor-parallel rank) is broken
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"prefill engine failed: {exc}")
            out: StepOutput = await stream.get()
            done = True
            if not out.new_token_ids:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "prefill was aborted")
            arrived, started, finished = (self._marks.get(rid, []) + [0.0, 0.0, 0.0])[:3]
            queue_s, compute_s = started - arrived, finished - started
            self.count("prefills")
            self.count("prompt_tokens", out.num_prompt_tokens)
            self.count("prefix_hit_tokens", out.num_cached_tokens)
            self.count("queue_s", queue_s)
            self.count("compute_s", compute_s)
            lp = out.new_logprobs[0] if out.new_logprobs else None
            return worker_pb.PrefillResponse(
                token_id=out.new_token_ids[0],
                logprob=logprob_to_pb(lp) if lp is not None else None,
                cached_tokens=out.num_cached_tokens, queue_s=queue_s, compute_s=compute_s,
                kv_bytes=self._kv_bytes(rid),
                prompt_logprobs=logprobs_to_pb(out.prompt_logprobs or []))
        finally:
            self._marks.pop(rid, None)
            self.streamer.sent_bytes.pop(rid, None)
            self.loop.close_stream(rid)
            if not done:
                await self._abort(rid)

    async def Abort(self, request, context):
        return worker_pb.AbortResponse(found=await self._abort(request.request_id))

    async def _abort(self, rid: str) -> bool:
        def run(engine: LLMEngine) -> bool:
            found = engine.abort(rid)
            self.streamer.abort(rid, "aborted")
            return found
        try:
            return await self.loop.call(run)
        except RuntimeError:
            return False  # a broken engine has nothing left to release

    def _kv_bytes(self, rid: str) -> int:
        return self.streamer.sent_bytes.pop(rid, 0)

    def _block_size(self) -> int:
        return self.loop.engine.config.block_size
