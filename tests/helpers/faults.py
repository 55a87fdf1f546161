"""Fault-test helpers: load over plain gRPC (no client retries), the engine's answers to
compare with, what the router counts, and what the workers hold."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from pdserve.engine import LLM, SamplingParams
from pdserve.launcher import LocalCluster
from pdserve.proto import pb, pb_grpc
from pdserve.serving.convert import params_to_pb
from tests.helpers.cluster import worker_stats

# Fast failure detection for tests: the router polls twice a second and gives a worker 2 s.
FAST_HEARTBEAT = ("--health-period", "0.5", "--heartbeat-timeout", "2")


@dataclass(frozen=True)
class Job:
    """One request: greedy, or seeded sampling with penalties (`seed` set)."""

    prompt: list[int]
    max_tokens: int
    seed: int | None = None

    @property
    def params(self) -> SamplingParams:
        if self.seed is None:
            return SamplingParams(max_tokens=self.max_tokens, temperature=0.0, ignore_eos=True)
        return SamplingParams(max_tokens=self.max_tokens, temperature=0.8, top_p=0.95,
                              repetition_penalty=1.2, seed=self.seed, ignore_eos=True)


def mixed_jobs(prompts: list[list[int]], max_tokens: int) -> list[Job]:
    """Every other request greedy, the rest seeded sampling."""
    return [Job(p, max_tokens, None if i % 2 == 0 else 1000 + i) for i, p in enumerate(prompts)]


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)
    code: grpc.StatusCode = grpc.StatusCode.OK
    details: str = ""
    finish_reason: int = 0
    max_gap_s: float = 0.0
    """Longest wait the client saw: from the call to the first chunk, or between chunks."""


async def run_jobs(address: str, jobs: list[Job], concurrency: int = 8, timeout_s: float = 120,
                   on_chunk: Callable[[int, Outcome], None] | None = None) -> list[Outcome]:
    """Each job as one streaming `Generate` over plain gRPC, `concurrency` at a time."""
    outcomes = [Outcome() for _ in jobs]
    gate = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.PDServeStub(channel)

        async def one(i: int, job: Job) -> None:
            out = outcomes[i]
            request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=job.prompt),
                                         sampling=params_to_pb(job.params))
            async with gate:
                last = time.monotonic()
                try:
                    async for msg in stub.Generate(request, timeout=timeout_s):
                        now = time.monotonic()
                        out.max_gap_s, last = max(out.max_gap_s, now - last), now
                        out.tokens += list(msg.token_ids)
                        out.finish_reason = msg.finish_reason or out.finish_reason
                        if on_chunk is not None:
                            on_chunk(i, out)
                except grpc.aio.AioRpcError as exc:
                    out.code, out.details = exc.code(), exc.details()

        await asyncio.gather(*(one(i, j) for i, j in enumerate(jobs)))
    return outcomes


async def run_http_jobs(cluster: LocalCluster, jobs: list[Job], timeout_s: float = 120
                        ) -> list[tuple[int, str]]:
    """Each job as one streaming OpenAI `/v1/completions` call (the official client, no
    retries): (HTTP status, text) per job."""
    import openai

    async with openai.AsyncOpenAI(base_url=f"http://{cluster.http_address}/v1",
                                  api_key="none", max_retries=0, timeout=timeout_s) as api:
        model = (await api.models.list()).data[0].id

        async def one(job: Job) -> tuple[int, str]:
            p = job.params
            extra = {"ignore_eos": True, "repetition_penalty": p.repetition_penalty}
            try:
                stream = await api.completions.create(
                    model=model, prompt=list(job.prompt), max_tokens=job.max_tokens,
                    temperature=p.temperature, top_p=p.top_p, seed=p.seed, stream=True,
                    extra_body=extra)
                return 200, "".join([c.choices[0].text async for c in stream if c.choices])
            except openai.APIStatusError as exc:
                return exc.status_code, str(exc)

        return list(await asyncio.gather(*(one(j) for j in jobs)))


def engine_outputs(model: Path, jobs: list[Job]) -> list[list[int]]:
    """What the single-process engine generates for each job: what a cluster must return."""
    llm = LLM(str(model), dtype="float32")
    try:
        outs = llm.generate([j.prompt for j in jobs], [j.params for j in jobs])
    finally:
        llm.close()
    return [o.token_ids for o in outs]


def router_metrics(cluster: LocalCluster) -> dict[str, float]:
    """The router's Prometheus samples, `name{labels}` → value."""
    with urllib.request.urlopen(f"http://{cluster.http_address}/metrics", timeout=10) as r:
        text = r.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def migrations(cluster: LocalCluster, cause: str | None = None) -> float:
    m = router_metrics(cluster)
    if cause is None:
        return m.get("pdserve_router_migrations_total", 0.0)
    return m.get(f'pdserve_router_migrations_by_cause_total{{cause="{cause}"}}', 0.0)


def held_requests(address: str) -> int:
    """Requests a worker holds now (running, queued or waiting for KV)."""
    s = worker_stats(address)
    return s.num_running + s.num_waiting


def wait_busy(address: str, timeout_s: float = 30.0, at_least: int = 1) -> int:
    """Poll a worker until it holds `at_least` requests (the fault is about to hit them)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        n = held_requests(address)
        if n >= at_least:
            return n
        time.sleep(0.01)
    raise AssertionError(f"worker {address} never held {at_least} requests")
