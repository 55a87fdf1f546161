"""The asyncio AsyncClient against a real gRPC server on loopback (see fake_pdserve)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.client import (
    AsyncClient,
    DeadlineExceeded,
    InvalidArgument,
    ModelCard,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    Usage,
)
from tests.client.fake_pdserve import FakeServer

pytestmark = pytest.mark.timeout(60)

FAST_RETRY = {"initial_backoff_s": 0.001, "max_backoff_s": 0.002}


async def _collect(client: AsyncClient, prompt, **kwargs):
    return [chunk async for chunk in client.stream(prompt, **kwargs)]


def test_generate_and_stream_assemble_the_same_result(fake: FakeServer):
    async def main():
        async with AsyncClient(fake.target) as client:
            completion = await client.generate([3, 4, 5], max_tokens=2, logprobs=0)
            chunks = await _collect(client, "abcde")
            return completion, chunks

    completion, chunks = asyncio.run(main())
    assert completion.token_ids == [3, 4] and completion.text == "<3><4>"
    assert completion.finish_reason == "length"
    assert completion.usage == Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=1)
    assert [lp.token_id for lp in completion.logprobs or []] == [3, 4]
    assert all(lp.top == [] for lp in completion.logprobs or [])
    assert [c.text for c in chunks] == ["ab", "cd", "e", ""]
    assert chunks[-1].finish_reason == "stop"


def test_a_client_built_outside_the_loop_works_inside_it(fake: FakeServer):
    client = AsyncClient(fake.target)

    async def main():
        try:
            return await client.list_models()
        finally:
            await client.close()

    assert asyncio.run(main()) == [ModelCard("tiny-llama", 2048, "pdserve")]


def test_errors_map_and_only_unavailable_is_retried(fake: FakeServer):
    fake.servicer.fail_before_output = [
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    ]

    async def main():
        async with AsyncClient(fake.target, **FAST_RETRY) as client:
            with pytest.raises(ResourceExhausted, match="^RESOURCE_EXHAUSTED: scripted"):
                await client.generate("a")

    asyncio.run(main())
    assert fake.servicer.calls == 3  # two retried UNAVAILABLEs, then a final RESOURCE_EXHAUSTED


def test_stream_retries_before_the_first_chunk_but_not_after(fake: FakeServer):
    fake.servicer.fail_before_output = [grpc.StatusCode.UNAVAILABLE]
    fake.servicer.fail_after_first_chunk = [None, None, grpc.StatusCode.UNAVAILABLE]

    async def main():
        async with AsyncClient(fake.target, **FAST_RETRY) as client:
            first = await _collect(client, "abc")  # call 1 fails at once, call 2 succeeds
            received = []
            with pytest.raises(Unavailable):
                async for chunk in client.stream("abcdef"):  # call 3 fails after a chunk
                    received.append(chunk.text)
            return first, received

    first, received = asyncio.run(main())
    assert "".join(c.text for c in first) == "abc"
    assert received == ["ab"]
    assert fake.servicer.calls == 3


def test_deadline_raises_deadline_exceeded(fake: FakeServer):
    fake.servicer.stall_before_output = True

    async def main():
        async with AsyncClient(fake.target) as client:
            with pytest.raises(DeadlineExceeded):
                await client.generate("abc", timeout=0.3)

    asyncio.run(main())
    assert fake.servicer.ended_early.wait(timeout=10)


def test_leaving_a_stream_early_cancels_the_request_on_the_server(fake: FakeServer):
    fake.servicer.stall_after_first_chunk = True

    async def main():
        async with AsyncClient(fake.target) as client:
            stream = client.stream("abcdef")
            assert (await anext(stream)).text == "ab"
            await stream.aclose()

    asyncio.run(main())
    assert fake.servicer.ended_early.wait(timeout=10)


def test_bearer_token_is_sent_and_checked(fake: FakeServer):
    fake.servicer.required_token = "t0k"

    async def main():
        async with AsyncClient(fake.target, token="t0k") as client:
            await client.generate("a")
        async with AsyncClient(fake.target, token="nope") as client:
            with pytest.raises(Unauthenticated):
                await client.generate("a")

    asyncio.run(main())
    assert fake.servicer.metadata[0]["authorization"] == "Bearer t0k"


def test_invalid_arguments_fail_before_any_call(fake: FakeServer):
    async def main():
        async with AsyncClient(fake.target) as client:
            with pytest.raises(InvalidArgument, match="top_k"):
                await client.generate("a", top_k=2**31)
            with pytest.raises(InvalidArgument, match="prompt"):
                client.stream("")

    asyncio.run(main())
    assert fake.servicer.calls == 0


def test_resource_exhausted_with_a_retry_hint_is_retried_after_the_hint(fake: FakeServer):
    fake.servicer.fail_before_output = [grpc.StatusCode.RESOURCE_EXHAUSTED]
    fake.servicer.retry_after_ms = "200"

    async def main():
        async with AsyncClient(fake.target, **FAST_RETRY) as client:
            return await _collect(client, "ab")

    assert "".join(c.text for c in asyncio.run(main())) == "ab"
    first, second = fake.servicer.call_times
    assert second - first >= 0.2  # never sooner than the server asked
