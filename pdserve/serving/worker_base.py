"""The part of the worker gRPC service both roles share: stats, info, abort, start-up.

A worker process announces itself on stdout with one line, `PDSERVE_READY {json}`, once its
servers are bound: the launcher (`pdserve up`) reads the real ports from it, so every server
can bind port 0 and no port is ever guessed. On SIGTERM it drains (`pdserve.serving.drain`):
the requests it has taken finish before it exits, and its polls are answered meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import os
import signal
from collections.abc import Awaitable, Callable

import grpc
import torch

from kv_store.index.events import BlockStored, encode_batch
from kv_store.index.recorder import BlockRecorder
from pdserve.block_hash import HASH_BYTES
from pdserve.observability.logs import configure_logging
from pdserve.observability.telemetry import WorkerTelemetry
from pdserve.observability.worker_metrics import WorkerSnapshot
from pdserve.proto import WORKER_API_VERSION, worker_pb, worker_pb_grpc
from pdserve.serving.drain import DrainGate
from pdserve.serving.engine_loop import EngineLoop
from pdserve.serving.grpc_server import RunningServer, start_server
from pdserve.serving.kv_push import PushError, push_kv
from pdserve.serving.kv_transport import KV_TRANSPORT_ENV, NIXL_READS_ENV
from pdserve.serving.security.secret import CLUSTER_SECRET_FILE_ENV
from pdserve.serving.worker_options import WorkerOptions, add_worker_args, options_from_args

log = logging.getLogger(__name__)


class WorkerServicerBase(worker_pb_grpc.WorkerServicer):
    def __init__(self, options: WorkerOptions, loop: EngineLoop,
                 recorder: BlockRecorder | None = None) -> None:
        self.options = options
        self.loop = loop
        self.recorder = recorder  # this worker's prefix-cache changes, for the KV index
        self.endpoints: list[worker_pb.KVEndpoint] = []
        self.counters: dict[str, float] = {}
        self.kv_sender = None  # KVSender for PushKV, set by the role's entry point
        self.gate = DrainGate()  # counts work calls; refuses new ones once draining

    def count(self, name: str, value: float = 1.0) -> None:
        self.counters[name] = self.counters.get(name, 0.0) + value

    async def GetStats(self, request, context):
        if not self.loop.alive:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine loop is not running")
        stats = self.loop.stats  # never waits for a step: a long prefill is not a dead worker
        speed = self.loop.meter.model()
        return worker_pb.WorkerStats(
            worker_id=self.options.worker_id, role=self.options.role,
            num_running=int(stats["num_running"]),
            num_waiting=int(stats["num_waiting"] + stats.get("num_waiting_for_kv", 0)),
            queued_prefill_tokens=int(stats["queued_prefill_tokens"]),
            kv_blocks_total=int(stats["kv_blocks_total"]),
            kv_blocks_used=int(stats["kv_blocks_used"]),
            kv_blocks_cached=int(stats["kv_blocks_cached"]),
            counters={**self.counters, "engine_steps": float(self.loop.steps),
                      **{k: float(v) for k, v in stats.items()
                         if k.startswith(("spec_", "kv_tier_", "prefix_cache_",
                                          "num_preemptions"))},
                      **self.transfer_counters()},
            kv_events=self._kv_events(request.kv_snapshot, request.take_kv_events),
            step_model=worker_pb.StepModel(step_base_s=speed.base_s,
                                           step_per_token_s=speed.per_token_s,
                                           samples=speed.samples),
            draining=self.gate.draining)

    def _kv_events(self, snapshot: bool, take: bool) -> bytes:
        """Prefix-cache changes since the last taker's poll (or everything held, on request).
        Only a taker drains them: the recorder has one consumer."""
        if self.recorder is None or self.options.redis_url or not (take or snapshot):
            return b""  # with --redis the index link is the recorder's one consumer
        events = self.recorder.drain() if take else []  # a non-taker must not lose them
        if snapshot:
            events = [BlockStored(self.recorder.worker_id, hashes, tier)
                      for tier, hashes in self.recorder.snapshot().items()]
        return encode_batch(events) if events else b""

    def transfer_counters(self) -> dict[str, float]:
        """Counters of the role's KV receiver, if it has one (none by default)."""
        return {}

    async def GetInfo(self, request, context):
        e = self.loop.engine
        return worker_pb.WorkerInfo(
            worker_id=self.options.worker_id, role=self.options.role, model_id=e.model_id,
            block_size=e.config.block_size, tp_size=e.config.tensor_parallel_size,
            max_model_len=e.max_model_len, endpoints=public_endpoints(self.endpoints),
            api_version=WORKER_API_VERSION, hash_extra=e.hash_extra,
            max_num_seqs=e.config.max_num_seqs,
            max_num_batched_tokens=e.config.max_num_batched_tokens,
            kv_bytes_per_block=e.kv_layout.block_bytes(e.tp.size))

    async def Prefetch(self, request, context):
        """Start promoting the listed blocks SSD → host so they are warm on arrival."""
        hashes = list(request.block_hashes)
        if any(len(h) != HASH_BYTES for h in hashes):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"block_hashes must be {HASH_BYTES} bytes each")
        if not self.loop.alive:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine loop is not running")
        started = await self.loop.call(
            lambda e: e.tiers.prefetch(hashes) if e.tiers is not None else 0)
        return worker_pb.PrefetchResponse(blocks_promoted=started)

    async def PushKV(self, request, context):
        """Send cached prompt blocks to a decode worker that pulls them (`serving.kv_push`)."""
        try:
            sent, nbytes = await push_kv(self.loop, self.kv_sender, request,
                                         context.time_remaining())
        except PushError as exc:
            await context.abort(exc.code, str(exc))
        if sent:
            self.count("kv_pushes")
            self.count("kv_pushed_blocks", sent)
        return worker_pb.PushKVResponse(blocks_sent=sent, kv_bytes=nbytes)

    def metrics_snapshot(self) -> WorkerSnapshot:
        """Engine stats as of the last step, and counters, for a metrics scrape; callable from
        any thread. `stats` is None if the engine is down."""
        stats = self.loop.stats if self.loop.alive else None
        e = self.loop.engine
        # dict() of a plain dict copies under the GIL: safe against transfer threads' updates.
        e = self.loop.engine
        return WorkerSnapshot(stats, {**self.counters, **self.transfer_counters()},
                              self.loop.steps, e.model_id, e.config.block_size)


def public_endpoints(endpoints: list[worker_pb.KVEndpoint]) -> list[worker_pb.KVEndpoint]:
    """The endpoints without their NIXL landing pools: those go only with a hand-off."""
    return [worker_pb.KVEndpoint(address=e.address, tp_rank=e.tp_rank, tp_size=e.tp_size)
            for e in endpoints]


def start_telemetry(options: WorkerOptions, service: WorkerServicerBase) -> WorkerTelemetry:
    """The worker's metrics (`/metrics` on `--metrics-host`:`--metrics-port`, with the
    worker's TLS and the metrics tokens) and request logging interceptor for its gRPC
    server."""
    sec = options.security
    return WorkerTelemetry(options.role, options.worker_id, service.metrics_snapshot,
                           options.metrics_host or options.host, options.metrics_port,
                           ("Prefill", "Decode"),
                           sec.tls.ssl_context() if sec.tls is not None else None,
                           sec.metrics_tokens)


def configure_process(options: WorkerOptions) -> None:
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` dumps every thread's stack
    configure_logging(options.role, options.worker_id, os.environ)
    if options.threads > 0:
        torch.set_num_threads(options.threads)


async def start_worker_server(options: WorkerOptions, service: WorkerServicerBase,
                              interceptors=()) -> RunningServer:
    """The worker's gRPC server (Worker service, health, reflection) on its host and port,
    with its TLS; callers are authenticated (`InternalSecurity.server_interceptors`) before
    any other interceptor sees the call, and the service's drain gate sees it last."""
    sec = options.security
    sec.warn_if_open(f"{options.role} worker {options.worker_id}")
    return await start_server(
        options.host, options.port,
        lambda s: worker_pb_grpc.add_WorkerServicer_to_server(service, s),
        [worker_pb.DESCRIPTOR.services_by_name["Worker"].full_name],
        tls=sec.tls, interceptors=[*sec.server_interceptors(), *interceptors, service.gate])


def run_worker(role: str, serve: Callable[[WorkerOptions], Awaitable[None]],
               argv: list[str] | None = None) -> None:
    """Entry point of a worker role: parse the shared flags, set up the process, serve."""
    parser = argparse.ArgumentParser(prog=f"{role}_worker")
    add_worker_args(parser)
    args = parser.parse_args(argv)
    try:
        options = options_from_args(role, args)
    except ValueError as exc:  # bad flags, unreadable TLS files or secret
        parser.error(str(exc))
    if args.cluster_secret_file:  # its tensor-parallel followers (children) read it too
        os.environ[CLUSTER_SECRET_FILE_ENV] = args.cluster_secret_file
    os.environ[KV_TRANSPORT_ENV] = options.kv_transport  # and use the same transport
    os.environ[NIXL_READS_ENV] = "1" if options.kv_nixl_reads else "0"
    configure_process(options)
    asyncio.run(serve(options))
