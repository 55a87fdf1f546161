"""Load for fault tests: plain gRPC clients (no SDK retries), each request's outcome recorded
with its client-visible status, tokens and timestamps, so a test can check what the fault hit."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc

from pdserve.proto import pb, pb_grpc


@dataclass
class Outcome:
    index: int
    status: str = "OK"
    """gRPC status name the client saw ("OK" when the stream finished)."""
    token_ids: list[int] = field(default_factory=list)
    started: float = 0.0
    first_token: float | None = None
    ended: float = 0.0
    trailing: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "OK"

    def in_flight_at(self, t: float) -> bool:
        return self.started <= t < self.ended


def greedy_request(prompt: list[int], max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


async def generate(stub: pb_grpc.PDServeStub, index: int, request: pb.GenerateRequest,
                   timeout_s: float, streaming: asyncio.Event | None = None) -> Outcome:
    """One request; `streaming` is set when its first token arrives."""
    out = Outcome(index, started=time.monotonic())
    call = stub.Generate(request, timeout=timeout_s)
    try:
        async for msg in call:
            if msg.token_ids and out.first_token is None:
                out.first_token = time.monotonic()
                if streaming is not None:
                    streaming.set()
            out.token_ids.extend(msg.token_ids)
    except grpc.aio.AioRpcError as exc:
        out.status = exc.code().name
        out.trailing = {k: v for k, v in (exc.trailing_metadata() or ())}
    finally:
        out.ended = time.monotonic()
    return out


async def run_load(address: str, requests: list[pb.GenerateRequest], concurrency: int,
                   timeout_s: float) -> list[Outcome]:
    """Every request once, `concurrency` at a time, in order."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.PDServeStub(channel)
        sem = asyncio.Semaphore(concurrency)

        async def one(i: int, r: pb.GenerateRequest) -> Outcome:
            async with sem:
                return await generate(stub, i, r, timeout_s)

        return list(await asyncio.gather(*(one(i, r) for i, r in enumerate(requests))))


async def signal_once_streaming(address: str, requests: list[pb.GenerateRequest],
                                fault, timeout_s: float = 120.0):
    """Start every request at once; when each has streamed a token, await `fault()` (it
    injects the fault and may probe the server). Returns (outcomes, when the fault began,
    what `fault()` returned)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.PDServeStub(channel)
        flags = [asyncio.Event() for _ in requests]
        tasks = [asyncio.ensure_future(generate(stub, i, r, timeout_s, flags[i]))
                 for i, r in enumerate(requests)]
        waits = [asyncio.ensure_future(f.wait()) for f in flags]
        await asyncio.wait([*waits], return_when=asyncio.ALL_COMPLETED, timeout=timeout_s)
        began = time.monotonic()
        result = await fault()
        return list(await asyncio.gather(*tasks)), began, result
