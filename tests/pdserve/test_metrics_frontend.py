"""The router's frontend feeds the request metrics however a request ends, and the HTTP
server exposes them on `/metrics`, behind the API's tokens or its own (no workers: the flow
is scripted)."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import aiohttp
import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.demo_model import write_tokenizer_files
from pdserve.engine.sampling_params import SamplingParams
from pdserve.observability.router_metrics import RouterMetrics
from pdserve.tokenizer import Tokenizer
from router.config import RouterConfig
from router.flow import FinishEvent, FlowError, TokenEvent
from router.frontend import Frontend
from router.openai import HttpConfig, OpenAIServer, ServedModel
from router.pool import WorkerPool
from router.validation import ValidRequest


class ScriptedFlow:
    def __init__(self, script) -> None:
        self.script = script
        self.rids: list[str] = []

    async def run(self, rid, req, timeout_s, timings, n=1, decode_allowed=None):
        self.rids.append(rid)
        for item in self.script:
            if isinstance(item, Exception):
                raise item
            yield item


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return Tokenizer.from_pretrained(write_tokenizer_files(tmp_path_factory.mktemp("tok"), 512))


def frontend(tokenizer, script) -> Frontend:
    pools = [WorkerPool(role, (), 1.0, 3) for role in ("prefill", "decode")]
    f = Frontend(RouterConfig(model="unused"), tokenizer, *pools, RouterMetrics())
    f.flow = ScriptedFlow(script)
    return f


def count(f: Frontend, name: str, **labels) -> float:
    return f.metrics.registry.get_sample_value(name, labels) or 0.0


REQ = ValidRequest("client-1", [10, 11, 12], SamplingParams(max_tokens=3))


async def drain(f: Frontend, stop_after: int | None = None) -> int:
    n = 0
    async with aclosing(f.generate(REQ, None)) as chunks:
        async for _ in chunks:
            n += 1
            if n == stop_after:
                break
    return n


def test_finished_request_counts_ok_tokens_and_ttft(tokenizer):
    f = frontend(tokenizer, [TokenEvent([20]), TokenEvent([21, 22]),
                             FinishEvent("length", 3, 3, 1)])
    asyncio.run(drain(f))
    assert f.flow.rids[0].startswith("client-1-")
    assert count(f, "pdserve_requests_total", status="OK") == 1
    assert count(f, "pdserve_generation_tokens_total") == 3
    assert count(f, "pdserve_prompt_tokens_total") == 3
    assert count(f, "pdserve_cached_prompt_tokens_total") == 1
    assert count(f, "pdserve_request_ttft_seconds_count") == 1
    assert count(f, "pdserve_request_itl_seconds_count") == 1
    assert count(f, "pdserve_request_e2e_seconds_count") == 1
    assert count(f, "pdserve_requests_inflight") == 0 and f.inflight == 0


def test_flow_error_is_counted_by_its_status(tokenizer):
    f = frontend(tokenizer, [TokenEvent([20]),
                             FlowError(grpc.StatusCode.UNAVAILABLE, "decode worker gone")])
    with pytest.raises(FlowError):
        asyncio.run(drain(f))
    assert count(f, "pdserve_requests_total", status="UNAVAILABLE") == 1
    assert count(f, "pdserve_requests_total", status="OK") == 0
    assert count(f, "pdserve_request_e2e_seconds_count") == 0
    assert count(f, "pdserve_requests_inflight") == 0


def test_client_leaving_early_counts_cancelled(tokenizer):
    f = frontend(tokenizer, [TokenEvent([20]), TokenEvent([21]),
                             FinishEvent("length", 3, 2, 0)])
    assert asyncio.run(drain(f, stop_after=1)) == 1
    assert count(f, "pdserve_requests_total", status="CANCELLED") == 1
    assert count(f, "pdserve_requests_inflight") == 0


def test_metrics_route_follows_the_api_auth_unless_it_has_tokens_of_its_own(tokenizer):
    f = frontend(tokenizer, [])
    model = ServedModel(id="tiny", max_model_len=128, vocab_size=512, created=1)

    async def get(s, address, path, token=None):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with s.get(f"http://{address}{path}", headers=headers) as r:
            return r.status, r.headers.get("Content-Type", ""), await r.text()

    async def main():
        api = OpenAIServer(f, model, HttpConfig(port=0, auth_tokens=("secret",)),
                           lambda: True, metrics=f.metrics.registry)
        own = OpenAIServer(f, model, HttpConfig(port=0, auth_tokens=("secret",),
                                                metrics_tokens=("scrape",)),
                           lambda: True, metrics=f.metrics.registry)
        a, b = await api.start(), await own.start()
        try:
            async with aiohttp.ClientSession() as s:
                assert (await get(s, a, "/v1/models"))[0] == 401
                assert (await get(s, a, "/metrics"))[0] == 401
                assert (await get(s, a, "/health"))[0] == 200
                assert (await get(s, b, "/metrics", "secret"))[0] == 401
                assert (await get(s, b, "/metrics", "scrape"))[0] == 200
                status, kind, text = await get(s, a, "/metrics", "secret")
                assert status == 200 and kind.startswith("text/plain")
                return text
        finally:
            await api.stop()
            await own.stop()

    names = {fam.name for fam in text_string_to_metric_families(asyncio.run(main()))}
    assert {"pdserve_requests", "pdserve_request_ttft_seconds"} <= names
