"""The router's flow with fake workers: when it asks a decode worker to pull a prefix, and
which prefetch hints it sends (fire-and-forget, failures only counted)."""

from __future__ import annotations

import asyncio
import random

import grpc

from kv_store.index.events import Tier
from kv_store.index.prefix import PrefixIndex
from pdserve.block_hash import chain_hashes
from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto import pb, worker_pb
from router.flow import FinishEvent, Flow, FlowTimings
from router.pool import WorkerHandle, WorkerPool
from router.validation import ValidRequest

EXTRA = bytes(range(16))
PROMPT = list(range(3, 215))  # 212 tokens: 13 full blocks, 20 tokens past block 12
HASHES = chain_hashes(PROMPT, 16, EXTRA)


class FakeCall:
    def __init__(self, events):
        self._events = iter(events)

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            return next(self._events)
        except StopIteration:
            raise StopAsyncIteration from None

    def cancel(self):
        return False


class FakeStub:
    def __init__(self, prefetch_fails=False):
        self.decodes, self.prefetches, self.prefills = [], [], []
        self.prefetch_fails = prefetch_fails

    def Decode(self, request, timeout=None):
        self.decodes.append(request)
        done = worker_pb.DecodeFinished(reason=pb.FINISH_REASON_LENGTH,
                                        prompt_tokens=len(request.prompt_token_ids))
        return FakeCall([worker_pb.DecodeEvent(ready=worker_pb.DecodeReady()),
                         worker_pb.DecodeEvent(finished=done)])

    async def Prefill(self, request, timeout=None):
        self.prefills.append(request)
        raise AssertionError("no prefill expected")

    async def Prefetch(self, request, timeout=None):
        self.prefetches.append(request)
        if self.prefetch_fails:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                       grpc.aio.Metadata(), "down")
        return worker_pb.PrefetchResponse()


def worker(address, role, used=0, prefetch_fails=False) -> WorkerHandle:
    w = WorkerHandle(address, role, None, FakeStub(prefetch_fails), healthy=True,
                     info=worker_pb.WorkerInfo(block_size=16, hash_extra=EXTRA, tp_size=1))
    w.stats = worker_pb.WorkerStats(kv_blocks_total=100, kv_blocks_used=used)
    return w


def hold(index, address, device, host=0, ssd=0):
    index.store(address, HASHES[:device], Tier.DEVICE)
    index.store(address, HASHES[device:device + host], Tier.HOST)
    index.store(address, HASHES[device + host:device + host + ssd], Tier.SSD)


def make_flow(decoders, prefillers, index) -> Flow:
    decode = WorkerPool("decode", (), 1.0, 3, index)
    prefill = WorkerPool("prefill", (), 1.0, 3, index)
    decode.workers, prefill.workers = decoders, prefillers
    return Flow(prefill, decode, 32, random.Random(0))


def run(flow) -> list:
    async def go():
        req = ValidRequest("r", PROMPT, SamplingParams(max_tokens=4))
        events = [ev async for ev in flow.run("r-1", req, 30.0, FlowTimings())]
        await asyncio.gather(*flow._background)  # the hints are fire-and-forget
        return events

    return asyncio.run(go())


def test_a_busy_holder_is_pulled_from_and_warmed_up():
    index = PrefixIndex()
    idle, busy, p = worker("d1", "decode"), worker("d2", "decode", used=90), worker("p", "prefill")
    hold(index, "d2", device=8, host=4)  # turn 1's 12 blocks, 4 of them demoted to host
    flow = make_flow([idle, busy], [p], index)
    assert isinstance(run(flow)[-1], FinishEvent)
    sent = idle.stub.decodes[0]
    assert sent.local_prefill and sent.kv_source.address == "d2" and sent.kv_source.blocks == 12
    assert [list(r.block_hashes) for r in busy.stub.prefetches] == [HASHES[8:12]]
    assert p.stub.prefills == [] and idle.stub.prefetches == []
    assert flow.counters["kv_pulls_routed"] == 1 and flow.counters["prefetch_hints"] == 1


def test_no_pull_when_the_chosen_worker_holds_the_prefix_but_its_ssd_blocks_are_hinted():
    index = PrefixIndex()
    d, p = worker("d1", "decode"), worker("p", "prefill")
    hold(index, "d1", device=4, ssd=8)
    hold(index, "p", device=12)
    flow = make_flow([d], [p], index)
    run(flow)
    assert not d.stub.decodes[0].HasField("kv_source")  # p holds no more than d
    assert [list(r.block_hashes) for r in d.stub.prefetches] == [HASHES[4:12]]
    assert p.stub.prefetches == []  # all of p's match is in device memory


def test_a_failed_hint_is_counted_and_the_request_goes_on():
    index = PrefixIndex()
    d = worker("d1", "decode", prefetch_fails=True)
    hold(index, "d1", device=2, host=10)
    flow = make_flow([d], [], index)
    assert isinstance(run(flow)[-1], FinishEvent)
    assert flow.counters["prefetch_hint_failures"] == 1
