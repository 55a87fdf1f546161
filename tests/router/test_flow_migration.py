"""Migration in the router's flow, with fake workers: what the next decode worker is sent,
that the client's stream goes on without a duplicate or a gap, when the router gives up,
and the pure policy behind it."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from kv_store.index.prefix import PrefixIndex
from pdserve.engine.finish import FinishReason
from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto import pb, worker_pb
from pdserve.serving.drain import DRAINING_METADATA_KEY
from router.flow import FinishEvent, Flow, FlowError, FlowTimings, TokenEvent
from router.migration import LostCause, MigrationPolicy, cause_of_decode_error, prefer_others
from router.pool import WorkerHandle, WorkerPool
from router.validation import ValidRequest

PROMPT = list(range(3, 40))
FULL = [100 + i for i in range(8)]  # what an undisturbed run generates


def rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), code.name)


class FakeDecodeCall:
    """A Decode stream: ready, then `script` (token batches, an error, or "hang"); cancel()
    wakes a pending read with CancelledError, as grpc.aio does."""

    def __init__(self, script):
        self._script = list(script)
        self._cancelled = asyncio.Event()
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.cancelled:
            raise asyncio.CancelledError
        if not self._script:
            raise StopAsyncIteration
        step = self._script.pop(0)
        if step == "hang":
            await self._cancelled.wait()
            raise asyncio.CancelledError
        if isinstance(step, BaseException):
            raise step
        return step

    def cancel(self):
        self.cancelled = True
        self._cancelled.set()
        return True


class FakeStub:
    def __init__(self, script_for):
        self.script_for = script_for  # DecodeRequest -> list of events
        self.decodes, self.calls = [], []

    def Decode(self, request, timeout=None):
        self.decodes.append(request)
        call = FakeDecodeCall(self.script_for(request))
        self.calls.append(call)
        return call

    async def Prefetch(self, request, timeout=None):
        return worker_pb.PrefetchResponse()


def ready():
    return worker_pb.DecodeEvent(ready=worker_pb.DecodeReady())


def tokens(ids):
    return worker_pb.DecodeEvent(tokens=worker_pb.TokenBatch(token_ids=ids))


def finished(n):
    return worker_pb.DecodeEvent(finished=worker_pb.DecodeFinished(
        reason=pb.FINISH_REASON_LENGTH, prompt_tokens=len(PROMPT), completion_tokens=n))


def honest(request):
    """A decode worker that continues correctly after what the request already has."""
    done = len(request.generated_token_ids)
    assert list(request.generated_token_ids) == FULL[:done]
    return [ready(), tokens(FULL[done:done + 3]), tokens(FULL[done + 3:]), finished(len(FULL))]


def worker(address, script_for) -> WorkerHandle:
    w = WorkerHandle(address, "decode", None, FakeStub(script_for), healthy=True,
                     info=worker_pb.WorkerInfo(block_size=16, hash_extra=b"x" * 16, tp_size=1))
    w.stats = worker_pb.WorkerStats(kv_blocks_total=100)
    return w


def make_flow(decoders, limit=3) -> Flow:
    index = PrefixIndex()
    decode, prefill = WorkerPool("decode", (), 1.0, 3.0, index), WorkerPool("prefill", (), 1.0,
                                                                            3.0, index)
    decode.workers = decoders
    return Flow(prefill, decode, 32, random.Random(0), migration=MigrationPolicy(limit))


async def collect(flow, on_token=None):
    req = ValidRequest("r", PROMPT, SamplingParams(max_tokens=len(FULL)))
    out, last = [], None
    async for ev in flow.run("r-1", req, 30.0, FlowTimings()):
        if isinstance(ev, TokenEvent):
            out += ev.token_ids
            if on_token is not None:
                on_token(out)
        else:
            last = ev
    return out, last


def test_a_decode_worker_dying_mid_stream_hands_the_request_on_with_its_tokens():
    dying = worker("d1", lambda r: [ready(), tokens(FULL[:3]),
                                    rpc_error(grpc.StatusCode.UNAVAILABLE)])
    other = worker("d2", honest)
    flow = make_flow([dying, other])
    out, last = asyncio.run(collect(flow))
    assert out == FULL and isinstance(last, FinishEvent) and last.reason is FinishReason.LENGTH
    (moved,) = other.stub.decodes
    assert list(moved.generated_token_ids) == FULL[:3] and moved.local_prefill
    assert moved.request_id == "r-1.m1" and moved.seed == dying.stub.decodes[0].seed
    assert not dying.healthy  # UNAVAILABLE: out of the pool
    assert flow.counters["migrations"] == 1 and flow.counters["migrations.decode_lost"] == 1


def test_a_decode_worker_that_stops_answering_is_cancelled_and_replaced():
    stalled = worker("d1", lambda r: [ready(), tokens(FULL[:2]), "hang"])
    other = worker("d2", honest)
    flow = make_flow([stalled, other])

    def heartbeat_lost(out):
        if len(out) == 2:  # the router's pool declares d1 down (its heartbeat timed out)
            asyncio.get_running_loop().call_soon(stalled.set_healthy, False)

    out, _ = asyncio.run(collect(flow, heartbeat_lost))
    assert out == FULL and stalled.stub.calls[0].cancelled  # no late token from d1 reaches us
    assert list(other.stub.decodes[0].generated_token_ids) == FULL[:2]
    assert flow.counters["migrations.decode_unresponsive"] == 1


def test_a_worker_that_ended_the_request_may_take_it_again_when_it_is_the_only_one():
    seen = []

    def once_aborted(request):
        seen.append(request)
        if len(seen) == 1:
            return [ready(), tokens(FULL[:1]), rpc_error(grpc.StatusCode.ABORTED)]
        return honest(request)

    only = worker("d1", once_aborted)
    flow = make_flow([only])
    out, _ = asyncio.run(collect(flow))
    assert out == FULL and len(seen) == 2 and only.healthy
    assert flow.counters["migrations.decode_ended"] == 1


def test_the_migration_limit_ends_the_request_with_unavailable():
    failing = worker("d1", lambda r: [ready(), rpc_error(grpc.StatusCode.ABORTED)])
    flow = make_flow([failing], limit=2)
    with pytest.raises(FlowError) as err:
        asyncio.run(collect(flow))
    assert err.value.code == grpc.StatusCode.UNAVAILABLE and "migration" in str(err.value)
    assert len(failing.stub.decodes) == 3  # the first try and two moves


def test_errors_that_are_not_the_workers_fault_do_not_migrate():
    slow = worker("d1", lambda r: [ready(), rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED)])
    flow = make_flow([slow, worker("d2", honest)])
    with pytest.raises(FlowError) as err:
        asyncio.run(collect(flow))
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert flow.counters["migrations"] == 0


def test_a_client_cancel_is_not_mistaken_for_a_lost_worker():
    stalled = worker("d1", lambda r: [ready(), tokens(FULL[:1]), "hang"])
    flow = make_flow([stalled, worker("d2", honest)])

    async def go():
        got_one = asyncio.Event()
        task = asyncio.create_task(collect(flow, lambda out: got_one.set()))
        await got_one.wait()
        await asyncio.sleep(0.01)  # the flow now waits on d1's stream
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())
    assert stalled.stub.calls[0].cancelled and flow.counters["migrations"] == 0


def draining_refusal() -> grpc.aio.AioRpcError:
    """What a draining worker answers a new call (`pdserve.serving.drain`)."""
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                grpc.aio.Metadata((DRAINING_METADATA_KEY, "1")), "draining")


def test_a_draining_decode_worker_gets_nothing_new_and_stays_in_its_pool():
    draining = worker("d1", honest)
    draining.draining = True  # as its stats said
    other = worker("d2", honest)
    flow = make_flow([draining, other])
    out, _ = asyncio.run(collect(flow))
    assert out == FULL and draining.stub.decodes == [] and len(other.stub.decodes) == 1
    assert draining.healthy and flow.decode.routable() == [other]


def test_a_refusal_from_a_draining_worker_is_placed_elsewhere_and_is_no_migration():
    refusing = worker("d1", lambda r: [draining_refusal()])
    other = worker("d2", honest)
    flow = make_flow([refusing, other])
    told = []
    refusing.watch(lambda: told.append("down"))  # a stream still running on d1
    out, _ = asyncio.run(collect(flow))
    assert out == FULL and len(other.stub.decodes) == 1
    assert other.stub.decodes[0].generated_token_ids == []  # nothing ran on d1
    assert refusing.healthy and refusing.draining and told == []  # d1's stream is not moved
    assert flow.counters["drain_refusals"] == 1 and flow.counters["migrations"] == 0


def test_policy_decisions():
    policy = MigrationPolicy(limit=2)
    assert policy.decide(LostCause.DECODE_LOST, 0, 10.0).migrate
    assert policy.decide(LostCause.DECODE_LOST, 2, 10.0).status == grpc.StatusCode.UNAVAILABLE
    assert policy.decide(LostCause.PREFILL_LOST, 0, 0.0).status == \
        grpc.StatusCode.DEADLINE_EXCEEDED
    assert cause_of_decode_error(grpc.StatusCode.ABORTED) is LostCause.DECODE_ENDED
    assert cause_of_decode_error(grpc.StatusCode.UNKNOWN) is LostCause.DECODE_LOST
    for code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                 grpc.StatusCode.DEADLINE_EXCEEDED):
        assert cause_of_decode_error(code) is None
    assert prefer_others(["a", "b"], str, {"a"}) == ["b"]
    assert prefer_others(["a"], str, {"a"}) == ["a"]
