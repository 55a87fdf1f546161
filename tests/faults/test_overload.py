"""Overload: a burst far over what the cluster can hold is shed at once. Every request either
completes with the engine's output or is refused with RESOURCE_EXHAUSTED (gRPC, with a
`retry-after-ms` hint) / 429 (HTTP, with Retry-After) before any token; an SDK client that
honours the hint gets every request through; the workers end idle.

The decode worker runs at most 4 requests at once (`--max-num-seqs 4`), so admission holds at
most 4 waves (16 requests) there: a burst of 48 must be refused in part, whatever the speed.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from pdserve.client import AsyncClient
from pdserve.engine import LLM
from tests.helpers.checkpoints import VOCAB
from tests.helpers.cluster import start_cluster, wait_idle
from tests.helpers.engine import greedy_ids, random_prompts
from tests.helpers.load import greedy_request, run_load

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 8
TIMEOUT_S = 60.0
PROMPTS = random_prompts([20, 60] * 24, VOCAB, seed=31)  # local and remote prefills


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory):
    c = start_cluster(tiny_llama, tmp_path_factory.mktemp("overload"), prefill=1, decode=1,
                      worker_args=("--max-num-seqs", "4"))
    yield c
    c.stop()


@pytest.fixture(scope="module")
def expected(tiny_llama):
    return greedy_ids(LLM(str(tiny_llama), dtype="float32"), PROMPTS, MAX_TOKENS)


def test_a_grpc_burst_completes_or_is_refused_at_once_with_a_retry_hint(cluster, expected):
    requests = [greedy_request(p, MAX_TOKENS) for p in PROMPTS]
    outcomes = asyncio.run(run_load(cluster.address, requests, len(requests), TIMEOUT_S))
    ok = [o for o in outcomes if o.ok]
    refused = [o for o in outcomes if o.status == "RESOURCE_EXHAUSTED"]
    assert len(ok) + len(refused) == len(outcomes), {o.status for o in outcomes}
    assert ok and refused  # the burst really overflowed the queue
    for o in ok:
        assert o.token_ids == expected[o.index]
    for o in refused:
        assert o.token_ids == [] and int(o.trailing["retry-after-ms"]) > 0
        assert o.ended - o.started < TIMEOUT_S / 4  # at once, not at the deadline
    assert not any(wait_idle(cluster).values())


def test_the_sdk_honours_the_hint_and_gets_every_request_through(cluster, expected):
    async def main():
        async with AsyncClient(cluster.address, max_retries=200) as client:
            return await asyncio.gather(*(
                client.generate(p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                timeout=120) for p in PROMPTS))

    got = asyncio.run(main())
    assert [c.token_ids for c in got] == expected
    assert not any(wait_idle(cluster).values())


def test_an_http_burst_gets_429_with_retry_after(cluster, expected):
    url = f"http://{cluster.http_address}/v1/completions"

    async def one(session, prompt):
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                "ignore_eos": True, "logprobs": 0}
        async with session.post(url, json=body) as r:
            return r.status, r.headers.get("Retry-After"), await r.text()

    async def main():
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(one(session, p) for p in PROMPTS))

    results = asyncio.run(main())
    statuses = [s for s, _, _ in results]
    assert set(statuses) <= {200, 429} and 200 in statuses and 429 in statuses
    for i, (status, retry, text) in enumerate(results):
        body = json.loads(text)
        if status == 429:
            assert int(retry) >= 1 and body["error"]["type"] == "rate_limit_error"
        else:
            ids = body["choices"][0]["logprobs"]["tokens"]
            assert len(ids) == len(expected[i])
    assert not any(wait_idle(cluster).values())
