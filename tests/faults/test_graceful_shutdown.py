"""SIGTERM under load: the router stops taking requests (UNAVAILABLE), reports NOT_SERVING,
and finishes the streams it has; a decode worker drains likewise, answering the router's
polls meanwhile, so its streams finish on it (no migration). Every stream in flight completes
with the engine's output, and the workers end idle."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.engine import LLM
from pdserve.proto import pb_grpc
from tests.helpers.checkpoints import VOCAB
from tests.helpers.cluster import start_cluster, wait_idle, worker_channel, worker_stats
from tests.helpers.engine import greedy_ids, random_prompts
from tests.helpers.faults import FAST_HEARTBEAT, migrations
from tests.helpers.load import generate, greedy_request, run_load, signal_once_streaming

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 400
PROMPTS = random_prompts([20, 50] * 5, VOCAB, seed=51)  # local and remote prefills
REQUESTS = [greedy_request(p, MAX_TOKENS) for p in PROMPTS]
# Decode drain: streams long enough to outlast the router's heartbeat timeout on the victim.
DRAIN_TOKENS = 700
DRAIN_PROMPTS = random_prompts([20, 50] * 3, VOCAB, seed=52)
DRAIN_REQUESTS = [greedy_request(p, DRAIN_TOKENS) for p in DRAIN_PROMPTS]
HEALTH_PERIOD_S, HEARTBEAT_TIMEOUT_S = (float(v) for v in FAST_HEARTBEAT[1::2])


@pytest.fixture(scope="module")
def expected(tiny_llama):
    return greedy_ids(LLM(str(tiny_llama), dtype="float32"), PROMPTS, MAX_TOKENS)


def test_router_sigterm_finishes_every_stream_in_flight(tiny_llama, tmp_path, expected):
    cluster = start_cluster(tiny_llama, tmp_path, prefill=1, decode=1)
    try:
        router = cluster.router

        async def sigterm_then_probe():
            router.proc.send_signal(signal.SIGTERM)
            async with grpc.aio.insecure_channel(cluster.address) as ch:
                health = health_pb2_grpc.HealthStub(ch)
                while (await health.Check(health_pb2.HealthCheckRequest(), timeout=10)
                       ).status != health_pb2.HealthCheckResponse.NOT_SERVING:
                    await asyncio.sleep(0.01)
                late = await generate(pb_grpc.PDServeStub(ch), -1,
                                      greedy_request(PROMPTS[0], 4), 10)
            return late.status

        outcomes, signalled_at, late = asyncio.run(
            signal_once_streaming(cluster.address, REQUESTS, sigterm_then_probe))
        assert late == "UNAVAILABLE"  # a new request while draining: retry elsewhere
        assert all(o.first_token is not None and o.first_token < signalled_at < o.ended
                   for o in outcomes)  # all ten were mid-stream
        assert [o.status for o in outcomes] == ["OK"] * 10
        assert [o.token_ids for o in outcomes] == expected
        assert router.proc.wait(timeout=60) == 0
        assert not any(wait_idle(cluster).values())
    finally:
        cluster.stop()


def test_a_draining_decode_worker_finishes_its_streams_itself(tiny_llama, tmp_path):
    """SIGTERM to one of two decode workers, streams in flight on it: it keeps answering the
    router's polls (saying it drains) past the heartbeat timeout, so the router neither drops
    it nor moves its streams; they finish there, and it exits."""
    expected = greedy_ids(LLM(str(tiny_llama), dtype="float32"), DRAIN_PROMPTS, DRAIN_TOKENS)
    cluster = start_cluster(tiny_llama, tmp_path, prefill=1, decode=2,
                            router_args=FAST_HEARTBEAT)
    try:
        victim = cluster.workers("decode")[0]
        address = victim.info["address"]

        async def sigterm_and_watch():
            running = (await asyncio.to_thread(worker_stats, address)).num_running
            victim.proc.send_signal(signal.SIGTERM)
            t0, seen, late, health = time.monotonic(), [], None, None
            while victim.proc.poll() is None:  # what its polls say until its server stops
                try:
                    s = await asyncio.to_thread(worker_stats, address)
                except grpc.RpcError:
                    break
                seen.append((time.monotonic() - t0, s.draining, s.num_running))
                if s.draining and late is None:  # new work meanwhile goes elsewhere
                    health = await asyncio.to_thread(_health, address)
                    late = asyncio.ensure_future(run_load(
                        cluster.address, [greedy_request(DRAIN_PROMPTS[0], 4)], 1, 30))
                await asyncio.sleep(0.05)
            return running, seen, health, await late if late is not None else None

        outcomes, _, (running, seen, health, late) = asyncio.run(
            signal_once_streaming(cluster.address, DRAIN_REQUESTS, sigterm_and_watch))
        assert running > 0, "the drained worker had no stream in flight"
        assert [o.status for o in outcomes] == ["OK"] * len(DRAIN_REQUESTS)
        assert [o.token_ids for o in outcomes] == expected
        assert victim.proc.wait(timeout=60) == 0
        # The fault reached far enough: streams still ran on it after the router's heartbeat
        # timeout (under which a worker that stopped answering would have lost them).
        still_running = [t for t, draining, n in seen if draining and n > 0]
        assert still_running and max(still_running) > HEARTBEAT_TIMEOUT_S + HEALTH_PERIOD_S
        assert health == health_pb2.HealthCheckResponse.NOT_SERVING  # Kubernetes, Ray: away
        assert late is not None and late[0].ok and late[0].token_ids == expected[0][:4]
        assert migrations(cluster) == 0  # every stream finished where it was
        assert not any(wait_idle(cluster).values())
    finally:
        cluster.stop()


def _health(address: str) -> int:
    with worker_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                    timeout=10).status
