"""Admission inside the frontend, over pools whose load is set by hand (no workers, the flow
scripted): a burst fills the decode queue and the rest is refused at once with a hint, the
prefill queue the router admitted counts before any stats show it, and finished requests free
their place, also before the next stats show it."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest

from pdserve.demo_model import write_tokenizer_files
from pdserve.engine.finish import FinishReason
from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto import worker_pb
from pdserve.tokenizer import Tokenizer
from router.config import RouterConfig
from router.flow import FinishEvent, TokenEvent
from router.frontend import Frontend, Overloaded
from router.pool import WorkerPool
from router.validation import RequestLimits, ValidRequest


class HeldFlow:
    """Each request takes its decode worker at once (as the real flow does before its first
    await) and holds it until released."""

    def __init__(self, decode: WorkerPool) -> None:
        self.decode = decode
        self.release = asyncio.Event()
        self.allowed: list[frozenset[str] | None] = []

    async def run(self, rid, req, timeout_s, timings, n=1, decode_allowed=None):
        self.allowed.append(decode_allowed)
        w = next(w for w in self.decode.workers if decode_allowed is None
                 or w.address in decode_allowed)
        w.started()
        try:
            await self.release.wait()
            yield TokenEvent([5])
            yield FinishEvent(FinishReason.LENGTH, len(req.prompt_token_ids), 1, 0)
        finally:
            w.ended()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return Tokenizer.from_pretrained(write_tokenizer_files(tmp_path_factory.mktemp("tok"), 512))


def pool(role: str, n: int, step: bool = True) -> WorkerPool:
    p = WorkerPool(role, tuple(f"127.0.0.1:{9000 + i}" for i in range(n)), 1.0, 3)
    for w in p.workers:
        w.healthy = True
        w.info = worker_pb.WorkerInfo(block_size=16, max_num_seqs=2, max_num_batched_tokens=64)
        w.stats = worker_pb.WorkerStats(kv_blocks_total=1000, step_model=worker_pb.StepModel(
            step_base_s=0.01, step_per_token_s=0.001, samples=10 if step else 0))
    return p


def frontend(tokenizer, decode: WorkerPool, prefill: WorkerPool) -> Frontend:
    f = Frontend(RouterConfig(model="unused", local_prefill_tokens=32), tokenizer, prefill,
                 decode, limits=RequestLimits(1024, 512, tokenizer.max_token_bytes))
    f.flow = HeldFlow(decode)
    return f


async def start(f: Frontend, n: int, prompt_len: int = 8, timeout: float = 600.0):
    """Start n requests; each task returns its chunks, or the Overloaded it raised."""
    async def one(i):
        req = ValidRequest(f"r{i}", [7] * prompt_len, SamplingParams(max_tokens=16))
        try:
            async with aclosing(f.generate(req, timeout)) as chunks:
                return [c async for c in chunks]
        except Overloaded as exc:
            return exc

    tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
    await asyncio.sleep(0)  # each ran to its first await: admitted or refused
    return tasks


def test_a_burst_fills_the_decode_queues_and_the_rest_is_refused_with_a_hint(tokenizer):
    async def main():  # pools open aio channels: inside the loop
        decode = pool("decode", 2)
        f = frontend(tokenizer, decode, pool("prefill", 0))
        tasks = await start(f, 40)
        refused = [t.result() for t in tasks if t.done()]
        f.flow.release.set()
        done = await asyncio.gather(*tasks)
        return f, decode, refused, done

    f, decode, refused, done = asyncio.run(main())
    # 2 slots x 4 waves on each of 2 decode workers; max_tokens 16 runs in well under 600 s.
    assert len(refused) == 40 - 16
    assert all(isinstance(r, Overloaded) and r.retry_after_s > 0 for r in refused)
    assert sum(1 for d in done if isinstance(d, list)) == 16
    assert f.inflight == 0 and all(w.inflight == 0 for w in decode.workers)
    assert all(a is not None and len(a) >= 1 for a in f.flow.allowed)


def test_an_unmeasured_decode_worker_takes_only_what_it_can_start(tokenizer):
    async def main():
        f = frontend(tokenizer, pool("decode", 1, step=False), pool("prefill", 0))
        tasks = await start(f, 5)
        f.flow.release.set()
        return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    assert sum(1 for r in results if isinstance(r, Overloaded)) == 3


def test_admitted_prefills_count_before_the_stats_show_them(tokenizer):
    # Slow prefill (64-token steps of 1 s + 0.1 s per token): the queue the router itself
    # admitted, not yet in any stats, pushes later requests past their deadline.
    async def main():
        prefill = pool("prefill", 1)
        prefill.workers[0].stats.step_model.CopyFrom(worker_pb.StepModel(
            step_base_s=1.0, step_per_token_s=0.1, samples=10))
        f = frontend(tokenizer, pool("decode", 1), prefill)
        tasks = await start(f, 8, prompt_len=100, timeout=60.0)  # remote prefills
        refused = sum(1 for t in tasks if t.done())
        f.flow.release.set()
        await asyncio.gather(*tasks)
        return refused

    # Two take the free slots at once; each later one waits for ~12 s of prefill per request
    # ahead of it, so only a few fit in 54 s.
    assert 2 < 8 - asyncio.run(main()) < 8


def test_a_request_that_ended_since_the_last_poll_no_longer_fills_the_queue(tokenizer):
    """A worker with room for one request of this size. Its last stats (taken while a request
    ran) show one; that request has since ended through this router: the next one is
    admitted, not refused on stale stats. A request the stats show that is not this router's
    still counts."""
    async def main():
        decode = pool("decode", 1)
        (w,) = decode.workers
        # 20 prompt + 16 output tokens: 3 blocks of 16, so one request runs; 2 prompt blocks
        # each, so one may wait: it holds one.
        w.stats.kv_blocks_total = 3
        f = frontend(tokenizer, decode, pool("prefill", 0))
        first = await start(f, 1, prompt_len=20)
        assert not first[0].done()  # admitted, running
        polled = worker_pb.WorkerStats()
        polled.CopyFrom(w.stats)
        polled.num_running = 1
        w.take_stats(polled, w.ended_since_poll)  # a poll while it ran
        f.flow.release.set()
        await asyncio.gather(*first)
        assert w.inflight == 0 and w.occupancy() == 0
        second = await asyncio.gather(*await start(f, 1, prompt_len=20))
        w.take_stats(polled, w.ended_since_poll)  # another router's request, still there
        third = await asyncio.gather(*await start(f, 1, prompt_len=20))
        return second, third

    second, third = asyncio.run(main())
    assert isinstance(second[0], list), second[0]
    assert isinstance(third[0], Overloaded) and "decode queue full (1 requests)" in str(third[0])
