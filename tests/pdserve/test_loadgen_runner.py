"""The runner against a fake backend: every request once, warm-up excluded, concurrency caps,
and the steady population."""

from __future__ import annotations

import asyncio
import math

from pdserve.loadgen.arrivals import ArrivalSpec
from pdserve.loadgen.datasets import BenchRequest, MixedSpec, RandomSpec, build_workload
from pdserve.loadgen.records import Recorder
from pdserve.loadgen.runner import RunConfig, run_workload


class FakeBackend:
    """Streams output_len tokens, one per event loop turn; tracks what is in flight."""

    def __init__(self, fail_kind: str | None = None) -> None:
        self.sent: list[BenchRequest] = []
        self.inflight: dict[str, int] = {}
        self.max_inflight: dict[str, int] = {}
        self.fail_kind = fail_kind

    async def server_info(self):
        raise NotImplementedError

    async def send(self, request):
        self.sent.append(request)
        k = request.kind
        self.inflight[k] = self.inflight.get(k, 0) + 1
        self.max_inflight[k] = max(self.max_inflight.get(k, 0), self.inflight[k])
        rec = Recorder(request.kind, len(request.prompt))
        try:
            for _ in range(request.output_len):
                await asyncio.sleep(0.001)
                rec.tokens(1)
            if request.kind == self.fail_kind:
                rec.fail("UNAVAILABLE")
        finally:
            self.inflight[k] -= 1
        return rec.result()

    async def close(self):
        pass


def test_every_request_is_sent_once_in_order_and_warmup_is_not_measured():
    workload = build_workload(RandomSpec(num_prompts=12, input_len=5, output_len=3), 0)
    warmup = build_workload(RandomSpec(num_prompts=2, input_len=4, output_len=2), 1).requests
    backend = FakeBackend()
    done = []
    run = asyncio.run(run_workload(backend, workload, RunConfig(ArrivalSpec(500.0)), warmup,
                                   on_done=done.append))
    assert backend.sent[:2] == list(warmup)
    assert backend.sent[2:] == list(workload.requests)
    assert len(run.results) == 12 and len(done) == 12
    assert all(r.ok and r.output_tokens == 3 and r.prompt_len == 5 for r in run.results)
    assert run.warmup_errors == 0 and run.duration_s > 0


def test_fixed_concurrency_never_exceeds_the_cap_and_reaches_it():
    workload = build_workload(RandomSpec(num_prompts=20, input_len=3, output_len=5), 0)
    backend = FakeBackend()
    run = asyncio.run(run_workload(backend, workload, RunConfig(ArrivalSpec(math.inf), 3)))
    assert len(run.results) == 20
    assert backend.max_inflight["random"] == 3


def test_infinite_rate_without_a_cap_sends_everything_at_once():
    workload = build_workload(RandomSpec(num_prompts=10, input_len=3, output_len=5), 0)
    backend = FakeBackend()
    asyncio.run(run_workload(backend, workload, RunConfig()))
    assert backend.max_inflight["random"] == 10


def test_steady_population_keeps_its_concurrency_and_stops_with_the_stream():
    spec = MixedSpec(num_prompts=4, input_len=8, output_len=20, short_input_len=2,
                     short_output_len=3, short_concurrency=2)
    backend = FakeBackend(fail_kind="short")
    run = asyncio.run(run_workload(backend, build_workload(spec, 0),
                                   RunConfig(ArrivalSpec(math.inf))))
    long = [r for r in run.results if r.kind == "long"]
    short = [r for r in run.results if r.kind == "short"]
    assert len(long) == 4 and all(r.ok for r in long)
    assert backend.max_inflight["short"] == 2
    assert len(short) > 2  # slots were refilled while the long requests ran
    assert all(r.error == "UNAVAILABLE" for r in short)  # failures are results, not exceptions
    assert backend.inflight == {"long": 0, "short": 0}  # nothing left running
