"""SIGTERM under load: the router stops taking requests (UNAVAILABLE), reports NOT_SERVING,
and finishes the streams it has; a decode worker drains likewise, answering the router's
polls meanwhile, so its streams finish on it (no migration). Every stream in flight completes
with the engine's output, and the workers end idle."""

from __future__ import annotations

import asyncio
import math
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.engine import LLM
from pdserve.proto import pb_grpc, worker_pb, worker_pb_grpc
from tests.helpers.checkpoints import VOCAB
from tests.helpers.cluster import start_cluster, wait_idle, worker_channel
from tests.helpers.engine import greedy_ids, random_prompts
from tests.helpers.faults import FAST_HEARTBEAT, migrations
from tests.helpers.load import generate, greedy_request, run_load, signal_once_streaming

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 400
PROMPTS = random_prompts([20, 50] * 5, VOCAB, seed=51)  # local and remote prefills
REQUESTS = [greedy_request(p, MAX_TOKENS) for p in PROMPTS]
# Decode drain: decode workers run one stream at a time (--max-num-seqs 1) and prefill these
# short prompts themselves; as many streams are queued on each as take (by a warm-up stream's
# speed) DRAIN_MARGIN times the router's heartbeat timeout, so the victim's drain outlasts it
# on a fast machine and stays short on a loaded one.
DRAIN_TOKENS = 950
HEALTH_PERIOD_S, HEARTBEAT_TIMEOUT_S = (float(v) for v in FAST_HEARTBEAT[1::2])
DRAIN_MARGIN = 3.0
MAX_STREAMS_PER_WORKER = 6
YOUNG_STREAM_BLOCKS = 12  # of the ~61 a 950-token stream fills: its first sixth


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
    """SIGTERM to one of two decode workers with streams running and queued on it: it keeps
    answering the router's polls (saying it drains) past the heartbeat timeout, so the router
    neither drops it nor moves its streams; they finish there, and it exits."""
    cluster = start_cluster(tiny_llama, tmp_path, prefill=1, decode=2,
                            worker_args=("--max-num-seqs", "1"),
                            router_args=(*FAST_HEARTBEAT, "--queue-waves", "16"))
    try:
        n = _streams_per_worker(cluster, DRAIN_MARGIN * (HEARTBEAT_TIMEOUT_S + HEALTH_PERIOD_S))
        prompts = random_prompts([20, 28] * n, VOCAB, seed=52)
        expected = greedy_ids(LLM(str(tiny_llama), dtype="float32"), prompts, DRAIN_TOKENS)
        victim = cluster.workers("decode")[0]
        with worker_channel(victim.info["address"]) as probe:
            poll = worker_pb_grpc.WorkerStub(probe).GetStats
            outcomes, (held, seen, health, late) = asyncio.run(
                _drain_under_streams(cluster, victim, poll, prompts))
        assert held >= 2, "the drained worker had no stream running and queued"
        assert [o.status for o in outcomes] == ["OK"] * len(prompts)
        assert [o.token_ids for o in outcomes] == expected
        assert victim.proc.wait(timeout=60) == 0
        # The fault reached far enough: streams still ran on it after the router's heartbeat
        # timeout (under which a worker that stopped answering would have lost them).
        still_running = [t for t, draining, running in seen if draining and running > 0]
        assert still_running and max(still_running) > HEARTBEAT_TIMEOUT_S + HEALTH_PERIOD_S, (
            f"{n} streams per worker ran only {max(still_running, default=0):.1f}s on it")
        assert health == health_pb2.HealthCheckResponse.NOT_SERVING  # readiness probes: away
        assert late is not None and late.ok and late.token_ids == expected[0][:4]
        assert migrations(cluster) == 0  # every stream finished where it was
        assert not any(wait_idle(cluster).values())
    finally:
        cluster.stop()


def _streams_per_worker(cluster, seconds: float) -> int:
    """How many DRAIN_TOKENS-token streams, run one after another, take `seconds` on a decode
    worker of `cluster`, judged by the speed of one warm-up stream (at least 2: one running,
    one queued)."""
    warm = greedy_request(random_prompts([24], VOCAB, seed=50)[0], 200)
    out = asyncio.run(run_load(cluster.address, [warm], 1, 120))[0]
    assert out.ok and out.first_token is not None, out.status
    per_token = (out.ended - out.first_token) / (len(out.token_ids) - 1)
    return min(MAX_STREAMS_PER_WORKER, max(2, math.ceil(seconds / (DRAIN_TOKENS * per_token))))


async def _drain_under_streams(cluster, victim, poll, prompts):
    """Start the streams; once the victim runs one and queues another, SIGTERM it and watch
    its polls until its server stops, sending one new request meanwhile. Returns the
    streams' outcomes and (requests it held, (seconds since SIGTERM, draining, running) per
    poll, its health status while draining, the new request's outcome)."""
    stats = lambda: asyncio.to_thread(poll, worker_pb.StatsRequest(), timeout=10)  # noqa: E731
    async with grpc.aio.insecure_channel(cluster.address) as channel:
        stub = pb_grpc.PDServeStub(channel)
        streams = [asyncio.ensure_future(generate(stub, i, greedy_request(p, DRAIN_TOKENS), 300))
                   for i, p in enumerate(prompts)]
        # SIGTERM while the running stream is young (its KV still a few blocks): the drain
        # then lasts most of it plus the queued one. Sent at any moment, it sometimes caught
        # a stream near its end and the drain beat the heartbeat timeout (CI, 2.3 s).
        end = time.monotonic() + 60
        while not ((s := await stats()).num_running >= 1 and s.num_waiting >= 1
                   and s.kv_blocks_used <= YOUNG_STREAM_BLOCKS):
            assert time.monotonic() < end, "the victim never held a young stream and a queued one"
            await asyncio.sleep(0.02)
        victim.proc.send_signal(signal.SIGTERM)
        t0, seen, health, late = time.monotonic(), [], None, None
        while victim.proc.poll() is None:
            try:
                p = await stats()
            except grpc.RpcError:
                break  # its server stopped: the drain is over
            seen.append((time.monotonic() - t0, p.draining, p.num_running))
            if p.draining and late is None:  # new work meanwhile goes to the other worker
                health = await asyncio.to_thread(_health, victim.info["address"])
                late = asyncio.ensure_future(
                    generate(stub, -1, greedy_request(prompts[0], 4), 120))
            await asyncio.sleep(0.05)
        outcomes = list(await asyncio.gather(*streams))
        return outcomes, (s.num_running + s.num_waiting, seen, health,
                          await late if late is not None else None)


def _health(address: str) -> int:
    with worker_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                    timeout=10).status
