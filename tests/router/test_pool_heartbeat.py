"""Heartbeats against fake workers on loopback: a worker that stops answering leaves its pool
within the heartbeat timeout (plus a tick), its watchers are told at once, the other workers'
polls go on meanwhile, and it is back as soon as it answers again."""

from __future__ import annotations

import asyncio

import grpc

from pdserve.proto import worker_pb, worker_pb_grpc
from router.pool import WorkerPool

PERIOD, HEARTBEAT = 0.05, 0.4


class FakeWorker(worker_pb_grpc.WorkerServicer):
    def __init__(self) -> None:
        self.polls = 0
        self.draining = False
        self.answering = asyncio.Event()
        self.answering.set()

    async def GetInfo(self, request, context):
        return worker_pb.WorkerInfo(role="decode", model_id="m", block_size=16)

    async def GetStats(self, request, context):
        await self.answering.wait()  # a stopped process: the call just hangs
        self.polls += 1
        return worker_pb.WorkerStats(role="decode", draining=self.draining)


async def serve() -> tuple[grpc.aio.Server, str, FakeWorker]:
    servicer = FakeWorker()
    server = grpc.aio.server()
    worker_pb_grpc.add_WorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}", servicer


async def until(check, timeout_s: float = 10.0) -> float:
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not check():
        assert loop.time() - start < timeout_s, "condition not reached"
        await asyncio.sleep(0.005)
    return loop.time() - start


def test_a_silent_worker_leaves_within_the_heartbeat_timeout_and_comes_back():
    async def go():
        (s1, a1, hung), (s2, a2, fine) = await serve(), await serve()
        pool = WorkerPool("decode", (a1, a2), PERIOD, HEARTBEAT)
        await pool.start()
        try:
            w1, w2 = pool.workers
            await until(lambda: w1.healthy and w2.healthy)
            told = []
            w1.watch(lambda: told.append("down"))
            hung.answering.clear()
            polls = fine.polls
            took = await until(lambda: not w1.healthy)
            assert told == ["down"] and w1.down.is_set()
            assert took < HEARTBEAT + 2 * PERIOD + 2.0  # bounded (the slack: a busy machine)
            assert fine.polls > polls + 3 and w2.healthy  # the hung worker delayed nobody
            hung.answering.set()
            await until(lambda: w1.healthy)
            assert not w1.down.is_set()  # a fresh event for the next outage
            w1.watch(lambda: told.append("again"))
            pool.mark_failed(w1)  # a failed call takes it out at once, watchers told
            assert told == ["down", "again"]
        finally:
            hung.answering.set()
            await pool.close()
            await s1.stop(None)
            await s2.stop(None)

    asyncio.run(go())


def test_a_draining_worker_stays_healthy_but_takes_nothing_new_until_it_exits():
    async def go():
        server, address, fake = await serve()
        pool = WorkerPool("decode", (address,), PERIOD, HEARTBEAT)
        await pool.start()
        try:
            (w,) = pool.workers
            await until(lambda: w.routable)
            told = []
            w.watch(lambda: told.append("down"))
            fake.draining = True
            await until(lambda: w.draining)
            assert pool.routable() == [] and pool.healthy() == [w]
            polls = fake.polls
            await until(lambda: fake.polls > polls + 2 * HEARTBEAT / PERIOD)  # past a timeout
            assert w.healthy and told == []  # it answers: its streams stay where they are
            assert await pool.wait_any_healthy(0.2) is False  # nothing to serve new work with
            await server.stop(None)  # the drain is over: it exits
            await until(lambda: not w.healthy)
            assert told == ["down"]
        finally:
            await pool.close()

    asyncio.run(go())


def test_a_router_that_could_not_watch_blames_no_worker_for_it():
    """The router's own process stalls (CPU starvation, a long GC) for longer than the
    heartbeat timeout while its workers answer: the answers wait in its sockets. When it
    resumes, the stall is not counted as the workers' silence: they stay in the pool (on a
    loaded CI machine, one late tick once took every worker out and failed every stream)."""
    import time

    async def go():
        (s1, a1, one), (s2, a2, two) = await serve(), await serve()
        pool = WorkerPool("decode", (a1, a2), PERIOD, HEARTBEAT)
        await pool.start()
        try:
            await until(lambda: all(w.healthy for w in pool.workers))
            told = []
            for w in pool.workers:
                w.watch(lambda: told.append("down"))
            polls = one.polls, two.polls
            await until(lambda: one.polls > polls[0] + 2 and two.polls > polls[1] + 2)
            time.sleep(3 * HEARTBEAT)  # blocks this event loop: the pool cannot poll
            polls = one.polls, two.polls
            await until(lambda: one.polls > polls[0] + 5 and two.polls > polls[1] + 5)
            assert told == [] and all(w.healthy for w in pool.workers)
            one.answering.clear()  # and a worker that then goes silent still leaves
            await until(lambda: told == ["down"])
            assert not pool.workers[0].healthy and pool.workers[1].healthy
        finally:
            one.answering.set()
            await pool.close()
            await s1.stop(None)
            await s2.stop(None)

    asyncio.run(go())
