"""Oversized and malformed requests against a real cluster: each gets a clean status (gRPC
INVALID_ARGUMENT / RESOURCE_EXHAUSTED, HTTP 400 / 413), never UNKNOWN, a 500 or a hang; health
checks keep answering while a huge request is refused; the router stays healthy and the
workers idle. Hypothesis fuzzes both public APIs: `pdserve.v1` messages (valid ones with wild
field values, and raw bytes) and OpenAI JSON bodies."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.proto import pb, pb_grpc
from tests.helpers.checkpoints import VOCAB
from tests.helpers.cluster import start_cluster, wait_idle
from tests.helpers.faults import router_metrics

pytestmark = pytest.mark.timeout(600)

CLEAN_GRPC = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
              grpc.StatusCode.RESOURCE_EXHAUSTED}
CLEAN_HTTP = {200, 400, 404, 405, 408, 413, 415, 429}
FUZZ = settings(max_examples=40, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])
# Small enough to run, or far out of range: never a long generation.
MAX_TOKENS = st.sampled_from([0, 1, 2, 3, 1025, 10**6, 2**32 - 1])


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory):
    c = start_cluster(tiny_llama, tmp_path_factory.mktemp("bad-requests"), prefill=1, decode=1)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def channel(cluster):
    with grpc.insecure_channel(cluster.address, options=[
            ("grpc.max_send_message_length", 128 << 20)]) as ch:
        yield ch


def _generate_status(channel, request: pb.GenerateRequest) -> grpc.StatusCode:
    try:
        for _ in pb_grpc.PDServeStub(channel).Generate(request, timeout=60):
            pass
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def _raw_status(channel, raw: bytes) -> grpc.StatusCode:
    rpc = channel.unary_stream("/pdserve.v1.PDServe/Generate", request_serializer=None,
                               response_deserializer=None)
    try:
        for _ in rpc(raw, timeout=60):
            pass
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def _healthy(cluster, channel) -> bool:
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def test_a_50mb_prompt_is_refused_while_health_checks_and_other_requests_go_on(cluster, channel):
    huge = pb.GenerateRequest(text="lorem ipsum " * (50 * 2**20 // 12))
    small = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7]),
                               sampling=pb.SamplingParams(max_tokens=2))

    async def main():
        async with grpc.aio.insecure_channel(cluster.address, options=[
                ("grpc.max_send_message_length", 128 << 20)]) as ch:
            stub = pb_grpc.PDServeStub(ch)
            health = health_pb2_grpc.HealthStub(ch)

            async def status(req):
                try:
                    [m async for m in stub.Generate(req, timeout=60)]
                except grpc.aio.AioRpcError as exc:
                    return exc.code()
                return grpc.StatusCode.OK

            big = asyncio.ensure_future(status(huge))
            checks = [await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
                      for _ in range(5)]
            return await big, checks, await status(small)

    before = router_metrics(cluster).get("pdserve_router_grpc_prefix_refusals_total", 0)
    big, checks, small_status = asyncio.run(main())
    assert big == grpc.StatusCode.RESOURCE_EXHAUSTED  # over the receive limit: never read
    refused = router_metrics(cluster)["pdserve_router_grpc_prefix_refusals_total"]
    assert refused == before + 1  # by the front, from its length prefix
    assert all(c.status == health_pb2.HealthCheckResponse.SERVING for c in checks)
    assert small_status == grpc.StatusCode.OK
    over_bound = pb.GenerateRequest(text="x" * (1024 * 64))  # under the limit, over the bound
    assert _generate_status(channel, over_bound) == grpc.StatusCode.INVALID_ARGUMENT


def test_malformed_protobuf_is_invalid_argument(cluster, channel):
    for raw in (b"\xff\xff\xff\xff", b"\x1a\x10short", b"\x1a\x02\xc3\x28", b"\x22\x03\x08"):
        assert _raw_status(channel, raw) == grpc.StatusCode.INVALID_ARGUMENT
    assert _healthy(cluster, channel)


def _params(**fields) -> pb.SamplingParams:
    return pb.SamplingParams(**{k: v for k, v in fields.items() if v is not None})


def _opt(strategy):
    return st.none() | strategy


# Valid requests with varied values (they must complete, and equal what the router computes
# for them anyway), and wild ones (any field any value its type allows).
VALID_SAMPLING = st.builds(
    _params, max_tokens=st.integers(1, 3), temperature=_opt(st.floats(0, 2, width=32)),
    top_p=_opt(st.floats(0.0625, 1, width=32)), top_k=_opt(st.integers(-1, 50)),
    seed=_opt(st.integers(0, 2**63 - 1)), stop=st.lists(st.text(min_size=1, max_size=4),
                                                       max_size=2),
    ignore_eos=st.booleans(), logprobs=_opt(st.integers(0, 5)))
WILD_SAMPLING = st.builds(
    _params, max_tokens=_opt(MAX_TOKENS), min_tokens=_opt(st.sampled_from([0, 1, 5, 2**31])),
    temperature=_opt(st.floats(width=32)), top_p=_opt(st.floats(width=32)),
    top_k=_opt(st.integers(-2**31, 2**31 - 1)), min_p=_opt(st.floats(width=32)),
    repetition_penalty=_opt(st.floats(width=32)), presence_penalty=_opt(st.floats(width=32)),
    frequency_penalty=_opt(st.floats(width=32)), seed=_opt(st.integers(0, 2**64 - 1)),
    stop=st.lists(st.text(max_size=8), max_size=3),
    stop_token_ids=st.lists(st.integers(0, 2**32 - 1), max_size=3),
    ignore_eos=st.booleans(), logprobs=_opt(st.integers(0, 2**32 - 1)))
VALID_PROMPT = st.one_of(
    st.builds(lambda t: {"text": t}, st.text(min_size=1, max_size=64)),
    st.builds(lambda ids: {"token_ids": pb.TokenIds(ids=ids)},
              st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40)))
WILD_PROMPT = st.one_of(
    st.builds(lambda t: {"text": t}, st.text(max_size=64)),
    st.builds(lambda ids: {"token_ids": pb.TokenIds(ids=ids)},
              st.lists(st.integers(0, 2**32 - 1), max_size=40)),
    st.just({}))


def _request():
    valid = st.builds(lambda rid, p, sampling: pb.GenerateRequest(
        request_id=rid, sampling=sampling, **p),
        st.text("abcXYZ019._:-", max_size=12), VALID_PROMPT, VALID_SAMPLING)
    wild = st.builds(lambda rid, model, p, sampling: pb.GenerateRequest(
        request_id=rid, model=model, sampling=sampling, **p),
        st.text(max_size=12), st.sampled_from(["", "other-model"]), WILD_PROMPT | VALID_PROMPT,
        WILD_SAMPLING | VALID_SAMPLING)
    return valid | wild


@FUZZ
@given(request=_request())
def test_fuzzed_generate_requests_get_a_clean_status(cluster, channel, request):
    assert _generate_status(channel, request) in CLEAN_GRPC


@FUZZ
@given(raw=st.binary(max_size=256))
def test_fuzzed_bytes_get_a_clean_status(cluster, channel, raw):
    assert _raw_status(channel, raw) in CLEAN_GRPC


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=16),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                               max_size=4),
    max_leaves=8)
_FIELDS = ["model", "prompt", "messages", "temperature", "top_p", "top_k", "n", "stream",
           "stream_options", "stop", "seed", "logprobs", "top_logprobs", "echo", "user",
           "min_tokens", "stop_token_ids", "frequency_penalty", "response_format", "bogus"]


def _body():
    text = st.text(min_size=1, max_size=64)
    ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30)
    role = st.sampled_from(["user", "system", "assistant"])
    valid = st.one_of(
        st.fixed_dictionaries({"prompt": text | ids, "max_tokens": st.integers(1, 3)}, optional={
            "temperature": st.floats(0, 2), "seed": st.integers(0, 2**62), "logprobs":
            st.integers(0, 5), "stop": st.lists(text, max_size=2)}),
        st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries(
            {"role": role, "content": st.text(max_size=32)}), min_size=1, max_size=3),
            "max_tokens": st.integers(1, 3)}, optional={"top_p": st.floats(0.01, 1)}))
    fields = st.dictionaries(st.sampled_from(_FIELDS), JSON, max_size=6)
    prompt = st.one_of(st.text(max_size=64), st.lists(st.integers(-5, 2 * VOCAB), max_size=30))
    messages = st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
         "content": st.text(max_size=32) | JSON}), max_size=3)
    wild = st.builds(lambda f, p, m, mt, which: {**f, which: p if which == "prompt" else m,
                                                "max_tokens": mt},
                     fields, prompt, messages, MAX_TOKENS,
                     st.sampled_from(["prompt", "messages"]))
    return valid | wild


async def _post(url: str, data: bytes) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as session:
        async with session.post(url, data=data, headers={"Content-Type": "application/json"},
                                timeout=aiohttp.ClientTimeout(total=60)) as r:
            return r.status, await r.read()


def _check_http(cluster, path: str, data: bytes) -> None:
    status, body = asyncio.run(_post(f"http://{cluster.http_address}{path}", data))
    assert status in CLEAN_HTTP, (status, body[:300])
    if status >= 400:
        assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}


@FUZZ
@given(body=_body(), stream=st.booleans())
def test_fuzzed_openai_bodies_get_a_clean_status(cluster, body, stream):
    body = {**body, "stream": stream} if "stream" not in body else body
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    _check_http(cluster, path, json.dumps(body).encode())


@FUZZ
@given(raw=st.binary(max_size=256), path=st.sampled_from(["/v1/completions",
                                                          "/v1/chat/completions"]))
def test_fuzzed_http_bytes_get_a_clean_status(cluster, raw, path):
    _check_http(cluster, path, raw)


def test_a_huge_http_body_is_413_and_the_router_stays_healthy(cluster, channel):
    status, body = asyncio.run(_post(f"http://{cluster.http_address}/v1/completions",
                                     b'{"prompt": "' + b"a" * (50 * 2**20) + b'"}'))
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    assert _healthy(cluster, channel)
    assert not any(wait_idle(cluster).values())
