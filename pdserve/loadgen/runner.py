"""Running a workload against a backend: warm-up, paced sends, the steady population.

    warm-up requests (all at once, excluded) ─► t0 ─┬─ open-loop stream: request i is sent at
                                                    │  t0 + offset_i, and only once fewer than
                                                    │  max_concurrency are in flight
                                                    └─ steady population: K slots, each sends its
                                                       next request when the previous one ends;
                                                       none starts after the stream's last request
                                                       ended (those in flight run to their end)
    ─► duration = t0 .. the last request's end

Latencies count from the moment a request is actually sent, so time spent waiting for a
concurrency slot is not charged to the server.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.loadgen.arrivals import ArrivalSpec, send_offsets
from pdserve.loadgen.backend import Backend
from pdserve.loadgen.datasets import BenchRequest, SteadySpec, Workload
from pdserve.loadgen.records import RequestResult


@dataclass(frozen=True)
class RunConfig:
    arrival: ArrivalSpec = ArrivalSpec()
    max_concurrency: int | None = None
    """Cap on open-loop requests in flight (None = no cap). With rate inf: fixed concurrency."""
    seed: int = 0
    """Seed of the arrival process."""

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"concurrency: must be >= 1, got {self.max_concurrency}")


@dataclass(frozen=True)
class RunResult:
    results: tuple[RequestResult, ...]
    """Every measured request (stream and steady population), warm-up excluded."""
    duration_s: float
    warmup_errors: int
    """Warm-up requests that failed (a hint that the server is not ready)."""


async def run_workload(backend: Backend, workload: Workload, config: RunConfig,
                       warmup: tuple[BenchRequest, ...] = (),
                       on_done: Callable[[RequestResult], None] | None = None) -> RunResult:
    """Sends warmup, then workload; on_done is called as each measured stream request ends."""
    warm = await asyncio.gather(*(backend.send(r) for r in warmup))
    start = time.perf_counter()
    stop = asyncio.Event()
    steady_tasks = []
    if workload.steady is not None:
        counter = itertools.count()
        steady_tasks = [asyncio.create_task(_steady_slot(backend, workload.steady, counter, stop))
                        for _ in range(workload.steady.concurrency)]
    try:
        stream = await _open_loop(backend, workload.requests, config, start, on_done)
    except BaseException:
        for t in steady_tasks:
            t.cancel()
        raise
    finally:
        stop.set()
    steady = [r for slot in await asyncio.gather(*steady_tasks) for r in slot]
    duration = time.perf_counter() - start
    return RunResult(tuple(stream) + tuple(steady), duration, sum(not r.ok for r in warm))


async def _open_loop(backend: Backend, requests: tuple[BenchRequest, ...], config: RunConfig,
                     start: float, on_done: Callable[[RequestResult], None] | None
                     ) -> list[RequestResult]:
    offsets = send_offsets(len(requests), config.arrival, config.seed)
    slots = asyncio.Semaphore(config.max_concurrency or max(1, len(requests)))

    async def one(request: BenchRequest) -> RequestResult:
        try:
            result = await backend.send(request)
        finally:
            slots.release()
        if on_done is not None:
            on_done(result)
        return result

    tasks = []
    try:
        for request, offset in zip(requests, offsets, strict=True):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            await slots.acquire()
            tasks.append(asyncio.create_task(one(request)))
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        raise


async def _steady_slot(backend: Backend, spec: SteadySpec, counter: itertools.count,
                       stop: asyncio.Event) -> list[RequestResult]:
    out = []
    while not stop.is_set():
        out.append(await backend.send(spec.request(next(counter))))
    return out
