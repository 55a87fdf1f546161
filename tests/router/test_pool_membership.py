"""Pool membership at run time: `WorkerPool.add` / `remove` against real gRPC channels to a
fake worker on loopback, `plan_membership`, `Membership` (discovery from a registry) and the
router's command line for its two modes."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from pdserve.proto import worker_pb, worker_pb_grpc
from router.__main__ import parse
from router.membership import Membership, MembershipPlan, plan_membership
from router.pool import WorkerPool

PERIOD = 0.05


class FakeWorker(worker_pb_grpc.WorkerServicer):
    def __init__(self) -> None:
        self.polls = 0

    async def GetInfo(self, request, context):
        return worker_pb.WorkerInfo(role="decode", model_id="m", block_size=16)

    async def GetStats(self, request, context):
        self.polls += 1
        return worker_pb.WorkerStats(role="decode")


async def fake_worker() -> tuple[grpc.aio.Server, str, FakeWorker]:
    servicer = FakeWorker()
    server = grpc.aio.server()
    worker_pb_grpc.add_WorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}", servicer


async def eventually(check, what: str, timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not check():
        if loop.time() > end:
            raise AssertionError(f"not within {timeout_s:.0f}s: {what}")
        await asyncio.sleep(0.01)


def closed(w) -> bool:
    return w.channel.get_state() == grpc.ChannelConnectivity.SHUTDOWN


def test_an_added_worker_becomes_routable_and_a_removed_one_stops_at_once():
    async def go():
        server, address, _ = await fake_worker()
        pool = WorkerPool("decode", (), PERIOD, 3)
        await pool.start()
        try:
            assert pool.healthy() == []
            w = pool.add(address)
            assert pool.add(address) is w and len(pool.workers) == 1  # idempotent
            await eventually(lambda: pool.healthy() == [w], "the new worker is healthy")
            assert w.info.model_id == "m"
            assert pool.remove(address) and not pool.remove(address)
            assert pool.healthy() == [] and pool.workers == []
            await eventually(lambda: closed(w), "the idle removed worker's channel closes")
        finally:
            await pool.close()
            await server.stop(None)

    asyncio.run(go())


def test_a_removed_worker_keeps_its_channel_while_a_flow_uses_it():
    async def go():
        server, address, servicer = await fake_worker()
        pool = WorkerPool("decode", (address,), PERIOD, 3, linger_s=0.0)
        await pool.start()
        try:
            (w,) = pool.healthy()
            w.inflight = 1  # a flow holds the handle
            pool.remove(address)
            polls = servicer.polls
            await eventually(lambda: servicer.polls >= polls + 3, "retiring worker polled")
            assert not closed(w) and w.healthy and not w.down.is_set()
            stats = await w.stub.GetStats(worker_pb.StatsRequest(), timeout=5)  # still works
            assert stats.role == "decode"
            w.inflight = 0  # the flow finished
            await eventually(lambda: closed(w), "channel closed once idle")
        finally:
            await pool.close()
            await server.stop(None)

    asyncio.run(go())


def test_a_worker_added_back_while_retiring_keeps_its_handle():
    async def go():
        server, address, _ = await fake_worker()
        pool = WorkerPool("decode", (address,), PERIOD, 3, linger_s=60.0)
        await pool.start()
        try:
            (w,) = pool.healthy()
            pool.remove(address)
            assert pool.add(address) is w and pool.healthy() == [w] and not closed(w)
        finally:
            await pool.close()
            await server.stop(None)
        assert closed(w)

    asyncio.run(go())


def test_a_retiring_worker_that_dies_sets_its_down_event():
    async def go():
        server, address, _ = await fake_worker()
        pool = WorkerPool("prefill", (address,), PERIOD, 2)
        await pool.start()
        try:
            (w,) = pool.healthy()
            w.inflight = 1  # a decode flow waits for this worker's KV
            pool.remove(address)
            await server.stop(None)
            await asyncio.wait_for(w.down.wait(), 10)
            assert not closed(w)  # still held: closed only once the flow lets go
        finally:
            await pool.close()

    asyncio.run(go())


def test_plan_joins_live_workers_of_the_model_and_drops_members_without_a_lease():
    registry = {
        "a:1": {"role": "decode", "model_id": "m"},
        "b:1": {"role": "prefill", "model_id": "m"},
        "c:1": {"role": "decode", "model_id": "other"},
        "d:1": {"role": "router", "model_id": "m"},
        "e:1": {"role": "prefill", "model_id": "m"},  # was a decode member: switches pools
    }
    members = {"decode": ["a:1", "gone:1", "e:1"], "prefill": []}
    plan = plan_membership(registry, "m", members)
    assert plan.join == (("prefill", "b:1"), ("prefill", "e:1"))
    assert plan.leave == (("decode", "e:1"), ("decode", "gone:1"))
    assert [a for a, _ in plan.ignored] == ["c:1", "d:1"]
    assert "'other'" in plan.ignored[0][1] and "'router'" in plan.ignored[1][1]
    assert plan_membership({}, "m", {"decode": [], "prefill": []}) == MembershipPlan()


class FakeRegistry:
    def __init__(self) -> None:
        self.live: dict[str, dict] = {}
        self.broken = False

    async def workers(self):
        if self.broken:
            raise ConnectionError("registry down")
        return {a: dict(i) for a, i in self.live.items()}


def test_membership_follows_the_registry_and_warns_once_per_foreign_worker(caplog):
    async def go():
        registry = FakeRegistry()
        pools = {r: WorkerPool(r, (), PERIOD, 3) for r in ("prefill", "decode")}
        m = Membership(registry, pools, "m", max_model_len=1024)
        registry.live = {"d:1": {"role": "decode", "model_id": "m", "max_model_len": 1024},
                         "x:1": {"role": "decode", "model_id": "other"}}
        with caplog.at_level(logging.WARNING, logger="router.membership"):
            await m.reconcile()
            await m.reconcile()
        assert [w.address for w in pools["decode"].workers] == ["d:1"]
        assert sum("x:1" in r.message for r in caplog.records) == 1
        registry.broken = True
        assert await m.reconcile() == MembershipPlan()  # unreadable: nothing changes
        assert [w.address for w in pools["decode"].workers] == ["d:1"]
        registry.broken, registry.live = False, {}
        await m.reconcile()
        assert pools["decode"].workers == [] and pools["prefill"].workers == []
        for pool in pools.values():
            await pool.close()

    asyncio.run(go())


def test_settle_gives_up_on_an_empty_registry():
    async def go():
        pools = {r: WorkerPool(r, (), PERIOD, 3) for r in ("prefill", "decode")}
        assert not await Membership(FakeRegistry(), pools, "m", 1024).settle(0.2)

    asyncio.run(go())


def test_command_line_picks_static_lists_or_discovery(monkeypatch):
    monkeypatch.delenv("PDSERVE_REDIS_URL", raising=False)  # the default of --redis
    static, _ = parse(["--model", "/m", "--decode", "h:1", "--redis", "redis://r:6379/0"])
    assert static.decode == ("h:1",) and not static.discover
    found, _ = parse(["--model", "/m", "--redis", "redis://r:6379/0", "--discover-wait", "0"])
    assert found.discover and found.decode == () and found.discovery_wait_s == 0.0
    for argv in (["--model", "/m"], ["--model", "/m", "--prefill", "h:1",
                                     "--redis", "redis://r:6379/0"]):
        with pytest.raises(SystemExit):
            parse(argv)
