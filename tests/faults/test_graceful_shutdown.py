"""SIGTERM under load: the router stops taking requests (UNAVAILABLE), reports NOT_SERVING,
and finishes the streams it has; a decode worker drains likewise, answering the router's
polls meanwhile, so its streams finish on it (no migration). Every stream in flight completes
with the engine's output, and the workers end idle."""

from __future__ import annotations

import asyncio
import contextlib
import math
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.client import AsyncClient
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
WARM_UP = random_prompts([20, 50], VOCAB, seed=52)  # one of each kind, sharing no prefix
# Decode drain: decode workers run one stream at a time (--max-num-seqs 1) and prefill these
# short prompts themselves; as many streams are queued on each as take (by a warm-up stream's
# speed) DRAIN_MARGIN times the router's heartbeat timeout, so the victim's drain outlasts it
# on a fast machine and stays short on a loaded one.
DRAIN_TOKENS = 950
HEALTH_PERIOD_S, HEARTBEAT_TIMEOUT_S = (float(v) for v in FAST_HEARTBEAT[1::2])
DRAIN_MARGIN = 3.0
# A cap of 6 let a fast machine (0.37 s a stream) drain them all inside the heartbeat timeout
# (CI, 2.2 s). The router queues up to QUEUE_WAVES on a worker (one slot each): room for all of
# them and for the new request sent during the drain, which a full queue would shed.
MAX_STREAMS_PER_WORKER = 16
QUEUE_WAVES = 2 * MAX_STREAMS_PER_WORKER
STREAM_BLOCKS = 61  # KV blocks a DRAIN_TOKENS-token stream fills by its end


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

        async def warm_up():
            # One request of each kind first: a cold pair's set-up (the prefill's KV
            # transfer to the decode worker) once held the remote streams' first tokens back
            # until every local stream had ended, so none was mid-stream at the signal.
            async with grpc.aio.insecure_channel(cluster.address) as ch:
                stub = pb_grpc.PDServeStub(ch)
                return [(await generate(stub, i, greedy_request(p, 4), 60)).status
                        for i, p in enumerate(WARM_UP)]

        assert asyncio.run(warm_up()) == ["OK", "OK"]
        outcomes, signalled_at, late = asyncio.run(
            signal_once_streaming(cluster.address, REQUESTS, sigterm_then_probe))
        assert late == "UNAVAILABLE"  # a new request while draining: retry elsewhere
        # The signal came mid-stream for both kinds (a loaded machine can finish one of the
        # first local prefills' streams before the last remote prefill starts): whatever ran
        # then must end OK, with the engine's tokens.
        mid = [o.first_token is not None and o.first_token < signalled_at < o.ended
               for o in outcomes]
        assert any(mid[0::2]) and any(mid[1::2]), f"mid-stream at the signal: {mid}"
        assert sum(mid) >= len(mid) // 2, f"mid-stream at the signal: {mid}"
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
                            router_args=(*FAST_HEARTBEAT, "--queue-waves", str(QUEUE_WAVES)))
    try:
        stream_s = _stream_seconds(cluster)
        n = min(MAX_STREAMS_PER_WORKER, max(2, math.ceil(
            DRAIN_MARGIN * (HEARTBEAT_TIMEOUT_S + HEALTH_PERIOD_S) / stream_s)))
        prompts = random_prompts([20, 28] * n, VOCAB, seed=52)
        expected = greedy_ids(LLM(str(tiny_llama), dtype="float32"), prompts, DRAIN_TOKENS)
        workers = cluster.workers("decode")
        with contextlib.ExitStack() as stack:
            polls = [worker_pb_grpc.WorkerStub(stack.enter_context(
                worker_channel(w.info["address"]))).GetStats for w in workers]
            outcomes, (victim, held, seen, health, late) = asyncio.run(
                _drain_under_streams(cluster, workers, polls, prompts, stream_s))
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
        assert late == expected[0][:4]
        assert migrations(cluster) == 0  # every stream finished where it was
        assert not any(wait_idle(cluster).values())
    finally:
        cluster.stop()


def _stream_seconds(cluster) -> float:
    """How long one DRAIN_TOKENS-token stream runs alone on a decode worker of `cluster`,
    judged by the speed of one warm-up stream."""
    warm = greedy_request(random_prompts([24], VOCAB, seed=50)[0], 200)
    out = asyncio.run(run_load(cluster.address, [warm], 1, 120))[0]
    assert out.ok, out.status
    # From its start, not its first token: on a loaded machine the first token can arrive
    # with many others, and its time then said 0.03 s a stream.
    return DRAIN_TOKENS * (out.ended - out.started) / len(out.token_ids)


async def _drain_under_streams(cluster, workers, polls, prompts, stream_s):
    """Start the streams; once every one is on a decode worker and one of them (the victim)
    holds enough of them to outlast the heartbeat timeout by half (judged by `stream_s`, one
    stream's time alone), SIGTERM it and watch its polls until its server
    stops, sending one new request meanwhile. Returns the streams' outcomes and (the victim,
    requests it held, (seconds since SIGTERM, draining, running) per poll, its health status
    while draining, the new request's tokens)."""
    def stats(i):
        return asyncio.to_thread(polls[i], worker_pb.StatsRequest(), timeout=10)

    async with grpc.aio.insecure_channel(cluster.address) as channel:
        stub = pb_grpc.PDServeStub(channel)
        streams = [asyncio.ensure_future(generate(stub, i, greedy_request(p, DRAIN_TOKENS), 300))
                   for i, p in enumerate(prompts)]
        # SIGTERM once the router has placed every stream (or it finished), to the worker
        # holding more, once what it holds (its queue and the rest of its running stream)
        # outlasts the timeout by half. Sent earlier, it caught the victim with 3 of its 8,
        # the rest went to the other worker, and the drain took 2.4 s (CI); sent at any
        # moment, it sometimes caught a last stream near its end (CI, 2.3 s).
        need_s = 1.5 * (HEARTBEAT_TIMEOUT_S + HEALTH_PERIOD_S)
        end = time.monotonic() + 60
        while True:
            both = await asyncio.gather(*(stats(i) for i in range(len(workers))))
            v = max(range(len(workers)), key=lambda i: both[i].num_running + both[i].num_waiting)
            s = both[v]
            left = s.num_waiting + max(0.0, 1.0 - s.kv_blocks_used / STREAM_BLOCKS)
            placed = sum(b.num_running + b.num_waiting for b in both)
            if (placed + sum(f.done() for f in streams) >= len(prompts)
                    and s.num_running >= 1 and s.num_waiting >= 1 and left * stream_s >= need_s):
                break
            assert time.monotonic() < end, (
                f"no worker held {need_s:.1f}s of streams ({stream_s:.2f}s each): " + "; ".join(
                    f"{b.num_running}+{b.num_waiting} in {b.kv_blocks_used} blocks"
                    for b in both) + f", of {len(prompts)}")
            await asyncio.sleep(0.02)
        victim = workers[v]
        victim.proc.send_signal(signal.SIGTERM)
        t0, seen, health, late = time.monotonic(), [], None, None
        while victim.proc.poll() is None:
            try:
                p = await stats(v)
            except grpc.RpcError:
                break  # its server stopped: the drain is over
            seen.append((time.monotonic() - t0, p.draining, p.num_running))
            if p.draining and late is None:  # new work meanwhile goes to the other worker
                health = await asyncio.to_thread(_health, victim.info["address"])
                late = asyncio.ensure_future(_late_request(cluster.address, prompts[0]))
            await asyncio.sleep(0.05)
        outcomes = list(await asyncio.gather(*streams))
        return outcomes, (victim, s.num_running + s.num_waiting, seen, health,
                          await late if late is not None else None)


async def _late_request(address: str, prompt: list[int]) -> list[int]:
    """A new request sent through the SDK, which waits out a RESOURCE_EXHAUSTED for as long
    as its retry-after says (on a slow machine the other worker's queue can be too long)."""
    async with AsyncClient(address, max_retries=20) as client:
        out = await client.generate(prompt, max_tokens=4, temperature=0.0, ignore_eos=True,
                                    timeout=120)
    return out.token_ids


def _health(address: str) -> int:
    with worker_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                    timeout=10).status
