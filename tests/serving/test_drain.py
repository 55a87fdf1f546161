"""A worker's drain on a real gRPC server on loopback, with a fake Worker service: while the
call it holds runs, polls are answered (and say `draining`), health is NOT_SERVING and new
work is refused with the `pdserve-draining` tag; the drain ends when the call does, or cuts
it at the timeout."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.proto import worker_pb, worker_pb_grpc
from pdserve.serving.drain import DrainConfig, DrainGate, DrainState, drain, is_draining_refusal
from pdserve.serving.grpc_server import start_server


class FakeWorker(worker_pb_grpc.WorkerServicer):
    """Decode streams one token, then waits for `release` and finishes."""

    def __init__(self, gate: DrainGate) -> None:
        self.gate = gate
        self.release = asyncio.Event()

    async def Decode(self, request, context):
        yield worker_pb.DecodeEvent(ready=worker_pb.DecodeReady())
        await self.release.wait()
        yield worker_pb.DecodeEvent(finished=worker_pb.DecodeFinished(completion_tokens=1))

    async def Prefill(self, request, context):
        return worker_pb.PrefillResponse(token_id=7)

    async def Abort(self, request, context):
        return worker_pb.AbortResponse(found=False)

    async def GetStats(self, request, context):
        return worker_pb.WorkerStats(draining=self.gate.draining)


async def serve():
    gate = DrainGate()
    fake = FakeWorker(gate)
    server = await start_server(
        "127.0.0.1", 0, lambda s: worker_pb_grpc.add_WorkerServicer_to_server(fake, s),
        [worker_pb.DESCRIPTOR.services_by_name["Worker"].full_name], interceptors=[gate])
    return server, gate, fake


async def open_stream(stub):
    call = stub.Decode(worker_pb.DecodeRequest(request_id="held"), timeout=30)
    first = await call.read()
    assert first.WhichOneof("event") == "ready"
    return call


async def until(check, timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not check():
        assert loop.time() < end, "condition not reached"
        await asyncio.sleep(0.01)


def test_a_draining_worker_answers_polls_refuses_new_work_and_finishes_what_it_holds():
    async def go():
        server, gate, fake = await serve()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            stub, health = worker_pb_grpc.WorkerStub(ch), health_pb2_grpc.HealthStub(ch)
            held = await open_stream(stub)
            assert gate.open == 1
            assert not (await stub.GetStats(worker_pb.StatsRequest(), timeout=5)).draining
            config = DrainConfig(grace_s=5.0)
            draining = asyncio.create_task(drain(server, gate, None, config=config))
            await until(lambda: gate.state is DrainState.REFUSING)
            assert (await stub.GetStats(worker_pb.StatsRequest(), timeout=5)).draining
            assert (await stub.Abort(worker_pb.AbortRequest(request_id="x"), timeout=5)
                    ) == worker_pb.AbortResponse()
            status = (await health.Check(health_pb2.HealthCheckRequest(), timeout=5)).status
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Decode(worker_pb.DecodeRequest(request_id="new"), timeout=5).read()
            assert is_draining_refusal(refused.value), refused.value
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Prefill(worker_pb.PrefillRequest(request_id="new"), timeout=5)
            assert is_draining_refusal(refused.value), refused.value
            assert not draining.done()  # the stream it holds keeps it draining
            fake.release.set()
            last = await held.read()
            assert last.finished.completion_tokens == 1 and await held.code() == grpc.StatusCode.OK
            assert await asyncio.wait_for(draining, 10) is True
            assert gate.state is DrainState.STOPPED and gate.open == 0
            with pytest.raises(grpc.aio.AioRpcError) as gone:
                await stub.GetStats(worker_pb.StatsRequest(), timeout=2)
            assert not is_draining_refusal(gone.value)  # stopped: an ordinary failure

    asyncio.run(go())


def test_the_drain_timeout_cuts_what_is_still_open():
    async def go():
        server, gate, _ = await serve()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            held = await open_stream(worker_pb_grpc.WorkerStub(ch))
            assert await drain(server, gate, None, config=DrainConfig(grace_s=0.2)) is False
            with pytest.raises(grpc.aio.AioRpcError) as cut:
                await held.read()
            assert not is_draining_refusal(cut.value)  # the router migrates a cut stream

    asyncio.run(go())


def test_drain_states_only_go_forward():
    gate = DrainGate()
    gate.advance(DrainState.REFUSING)  # the notice may be skipped
    assert gate.draining
    with pytest.raises(ValueError):
        gate.advance(DrainState.NOTICE)
