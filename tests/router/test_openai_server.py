"""The HTTP server over a scripted frontend (no workers): routes, SSE framing, auth, error
mapping, limits, and cancellation when the client goes away."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import aiohttp
import grpc
import pytest

from pdserve.demo_model import write_tokenizer_files
from pdserve.tokenizer import Tokenizer
from router.flow import FlowError
from router.frontend import OutputChunk, Overloaded, Usage
from router.openai import HttpConfig, OpenAIServer, ServedModel
from router.tokenize import TokenizerPool

MODEL = ServedModel(id="tiny", max_model_len=128, vocab_size=512, created=1)
HANG = object()  # script item: wait until cancelled
SCRIPT = [OutputChunk([75], "he"), OutputChunk([76], "llo", [], "length", Usage(3, 2, 0))]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return Tokenizer.from_pretrained(write_tokenizer_files(tmp_path_factory.mktemp("tok"), 512))


class ScriptedFrontend:
    """Plays a list of chunks (or raises an exception / hangs) for every request."""

    def __init__(self, tokenizer, script):
        self.tokenizer = tokenizer
        self.tokens = TokenizerPool(tokenizer)
        self.script = script
        self.inflight = 0
        self.requests = []
        self.closed = 0  # generators that ran their cleanup

    async def generate_choices(self, reqs, n, timeout_s):
        """Every choice plays the script in turn (its chunks tagged with the choice)."""
        self.requests.extend(reqs)
        self.choices = n
        try:
            for index in range(len(reqs) * n):
                for item in self.script:
                    if item is HANG:
                        await asyncio.Event().wait()
                    if isinstance(item, Exception):
                        raise item
                    yield dataclasses.replace(item, index=index)
        finally:
            self.closed += 1


def serve(tokenizer, script=SCRIPT, scenario=None, tokens=(), **http_kw):
    """Start the server on a free port, run `scenario(session, base_url, frontend)`, stop."""
    frontend = ScriptedFrontend(tokenizer, script)

    async def main():
        config = HttpConfig(port=0, auth_tokens=tokens, **{"max_body_bytes": 4096, **http_kw})
        server = OpenAIServer(frontend, MODEL, config, lambda: True)
        address = await server.start()
        try:
            async with aiohttp.ClientSession() as session:
                return await scenario(session, f"http://{address}", frontend)
        finally:
            await server.stop()

    return asyncio.run(main()), frontend


async def post(session, url, body, headers=None):
    async with session.post(url, json=body, headers=headers) as resp:
        return resp.status, await resp.json(), resp.headers.get("Content-Type", "")


async def post_stream(session, url, body):
    async with session.post(url, json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        raw = (await resp.read()).decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    return [e[6:] for e in events]


def test_completion_json(tokenizer):
    body = {"model": "tiny", "prompt": "hello world", "max_tokens": 2, "seed": 3}
    (status, out, ctype), fe = serve(tokenizer, scenario=lambda s, u, f: post(
        s, f"{u}/v1/completions", body))
    assert status == 200 and ctype.startswith("application/json")
    assert out["id"].startswith("cmpl-") and out["object"] == "text_completion"
    assert out["choices"] == [{"index": 0, "text": "hello", "logprobs": None,
                               "finish_reason": "length", "stop_reason": None,
                               "prompt_logprobs": None}]
    assert out["usage"]["total_tokens"] == 5
    (req,) = fe.requests
    assert req.prompt_token_ids == tokenizer.encode("hello world")
    assert (req.params.max_tokens, req.params.seed) == (2, 3)
    assert req.request_id == out["id"]


def test_completion_stream_with_usage(tokenizer):
    body = {"model": "tiny", "prompt": [5, 6, 7], "stream": True,
            "stream_options": {"include_usage": True}}
    events, fe = serve(tokenizer, scenario=lambda s, u, f: post_stream(
        s, f"{u}/v1/completions", body))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == ["he", "llo"]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, "length"]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2
    assert len({c["id"] for c in chunks}) == 1
    assert fe.requests[0].prompt_token_ids == [5, 6, 7]


def test_chat_stream_uses_the_template_and_starts_with_the_role(tokenizer):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    events, fe = serve(tokenizer, scenario=lambda s, u, f: post_stream(
        s, f"{u}/v1/chat/completions", body))
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "hello"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "usage" not in chunks[-1]
    assert fe.requests[0].prompt_token_ids == tokenizer.encode_chat(body["messages"])


def test_chat_json(tokenizer):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    (status, out, _), _ = serve(tokenizer, scenario=lambda s, u, f: post(
        s, f"{u}/v1/chat/completions", body))
    assert status == 200 and out["id"].startswith("chatcmpl-")
    assert out["choices"][0]["message"]["content"] == "hello"


def test_models_and_health(tokenizer):
    async def scenario(s, u, f):
        got = []
        for path in ("/v1/models", "/v1/models/tiny", "/v1/models/other", "/health"):
            async with s.get(u + path) as resp:
                got.append((resp.status, await resp.json()))
        return got

    got, _ = serve(tokenizer, scenario=scenario)
    assert got[0] == (200, {"object": "list", "data": [got[1][1]]})
    assert got[1][1]["id"] == "tiny"
    assert got[2][0] == 404 and got[2][1]["error"]["code"] == "model_not_found"
    assert got[3] == (200, {"status": "ok"})


def test_invalid_field_is_a_400_naming_it(tokenizer):
    body = {"model": "tiny", "prompt": "x", "temperature": -1}
    (status, out, _), fe = serve(tokenizer, scenario=lambda s, u, f: post(
        s, f"{u}/v1/completions", body))
    assert status == 400
    assert out["error"]["param"] == "temperature" and "temperature" in out["error"]["message"]
    assert out["error"]["type"] == "invalid_request_error"
    assert fe.requests == []


def test_http_level_errors_are_openai_shaped(tokenizer):
    async def scenario(s, u, f):
        got = []
        async with s.get(f"{u}/v1/nope") as r:
            got.append((r.status, await r.json()))
        async with s.get(f"{u}/v1/completions") as r:
            got.append((r.status, await r.json()))
        async with s.post(f"{u}/v1/completions", data=b"x" * 5000,
                          headers={"Content-Type": "application/json"}) as r:
            got.append((r.status, await r.json()))
        async with s.post(f"{u}/v1/completions", data=b"{not json",
                          headers={"Content-Type": "application/json"}) as r:
            got.append((r.status, await r.json()))
        async with s.post(f"{u}/v1/completions", data={"prompt": "x"}) as r:  # a form
            got.append((r.status, await r.json()))
        return got

    got, _ = serve(tokenizer, scenario=scenario)
    assert [s for s, _ in got] == [404, 405, 413, 400, 415]
    assert all(set(b["error"]) == {"message", "type", "param", "code"} for _, b in got)


def test_bearer_tokens(tokenizer):
    body = {"model": "tiny", "prompt": "x"}

    async def scenario(s, u, f):
        none = await post(s, f"{u}/v1/completions", body)
        wrong = await post(s, f"{u}/v1/completions", body, {"Authorization": "Bearer nope"})
        right = await post(s, f"{u}/v1/completions", body, {"Authorization": "Bearer s3cret"})
        async with s.get(f"{u}/health") as r:
            health = r.status
        return none, wrong, right, health

    (none, wrong, right, health), fe = serve(tokenizer, scenario=scenario, tokens=("s3cret",))
    assert none[0] == wrong[0] == 401
    assert none[1]["error"]["code"] == "invalid_api_key"
    assert right[0] == 200 and health == 200
    assert len(fe.requests) == 1


@pytest.mark.parametrize("code, status", [
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429), (grpc.StatusCode.UNAVAILABLE, 503),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504), (grpc.StatusCode.INVALID_ARGUMENT, 400),
    (grpc.StatusCode.CANCELLED, 499), (grpc.StatusCode.INTERNAL, 500),
])
def test_flow_errors_before_output_map_to_http_statuses(tokenizer, code, status):
    body = {"model": "tiny", "prompt": "x", "stream": True}
    (got, out, _), _ = serve(tokenizer, [FlowError(code, "boom")], scenario=lambda s, u, f: post(
        s, f"{u}/v1/completions", body))
    assert got == status and out["error"]["message"] == "boom"


def test_admission_refusal_answers_429_with_retry_after(tokenizer):
    body = {"model": "tiny", "prompt": "x"}

    async def scenario(s, u, f):
        async with s.post(f"{u}/v1/completions", json=body) as r:
            return r.status, await r.json(), r.headers.get("Retry-After")

    (status, out, retry), _ = serve(tokenizer, [Overloaded("over capacity", 2.2)],
                                    scenario=scenario)
    assert status == 429 and out["error"]["type"] == "rate_limit_error"
    assert retry == "3"  # whole seconds, rounded up


def test_oversized_prompt_text_is_refused_before_tokenising(tokenizer):
    big = "word " * 1000  # over max_model_len (128) x 4 bytes: cannot fit, whatever its tokens
    body = {"model": "tiny", "prompt": big}
    (status, out, _), fe = serve(tokenizer, scenario=lambda s, u, f: post(
        s, f"{u}/v1/completions", body), max_body_bytes=1 << 20)
    assert status == 400 and out["error"]["param"] == "prompt"
    assert "longer than" in out["error"]["message"] and fe.requests == []


def test_a_body_announced_too_large_is_refused_before_it_is_read(tokenizer):
    async def scenario(s, u, f):
        reader, writer = await asyncio.open_connection(*u[len("http://"):].split(":"))
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 99999999\r\n\r\n{")
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        writer.close()
        return head

    head, _ = serve(tokenizer, scenario=scenario)
    assert head.startswith(b"HTTP/1.1 413")


@pytest.mark.parametrize("what", ["head", "body"])
def test_slow_clients_get_408(tokenizer, what):
    async def scenario(s, u, f):
        reader, writer = await asyncio.open_connection(*u[len("http://"):].split(":"))
        if what == "head":
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # never ends
        else:
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 50\r\n\r\n{")
        await writer.drain()
        # The server answers, then closes: at once, not after reading on for the rest of a
        # body (aiohttp lingers 10 s for that by default).
        data = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        return data

    data, fe = serve(tokenizer, scenario=scenario, header_timeout_s=0.3, body_timeout_s=0.3)
    assert data.startswith(b"HTTP/1.1 408")
    assert b"\r\nConnection: close\r\n" in data.split(b"\r\n\r\n", 1)[0] + b"\r\n"
    assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    assert fe.requests == []


def test_error_mid_stream_is_a_final_error_event(tokenizer):
    script = [SCRIPT[0], FlowError(grpc.StatusCode.UNAVAILABLE, "decode worker lost")]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    events, _ = serve(tokenizer, script, scenario=lambda s, u, f: post_stream(
        s, f"{u}/v1/chat/completions", body))
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["message"] == "decode worker lost" and err["code"] == "unavailable"


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_closes_the_request(tokenizer, stream):
    body = {"model": "tiny", "prompt": "x", "stream": stream}

    async def scenario(s, u, f):
        resp_cm = s.post(f"{u}/v1/completions", json=body)
        task = asyncio.ensure_future(resp_cm.__aenter__())
        while not f.requests:
            await asyncio.sleep(0.01)
        if stream:
            resp = await task
            await resp.content.readuntil(b"\n\n")  # the first event arrived
            resp.close()
        else:
            task.cancel()  # drops the connection while the server waits for output
        for _ in range(500):  # the server notices the closed connection
            if f.closed:
                return f.closed
            await asyncio.sleep(0.01)
        return f.closed

    closed, _ = serve(tokenizer, [SCRIPT[0], HANG], scenario=scenario)
    assert closed == 1


def test_unexpected_failure_mid_stream_is_a_500_event(tokenizer):
    body = {"model": "tiny", "prompt": "x", "stream": True}
    events, fe = serve(tokenizer, [SCRIPT[0], RuntimeError("bug")], scenario=lambda s, u, f:
                       post_stream(s, f"{u}/v1/completions", body))
    assert json.loads(events[-2])["error"]["type"] == "server_error"
    assert events[-1] == "[DONE]" and fe.closed == 1


def test_router_flags_configure_the_http_api(monkeypatch):
    from router.__main__ import parse

    monkeypatch.setenv("PDSERVE_AUTH_TOKENS", "a,b")
    base = ["--model", "m", "--decode", "127.0.0.1:1", "--host", "0.0.0.0"]
    cfg, http = parse(base)
    assert (http.host, http.port, http.auth_tokens) == ("0.0.0.0", 8000, cfg.auth_tokens)
    assert cfg.auth_tokens == ("a", "b")
    _, http = parse([*base, "--http-port", "0", "--http-host", "127.0.0.1"])
    assert (http.host, http.port) == ("127.0.0.1", 0)
    assert parse([*base, "--http-port", "-1"])[1] is None


@pytest.mark.parametrize("raw", [
    b"GARBAGE\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"POST /v1/completions HTTP/1.1\r\nX: " + b"a" * 10000 + b"\r\n\r\n",
])
def test_malformed_http_is_an_openai_shaped_400(tokenizer, raw):
    async def scenario(s, u, f):
        reader, writer = await asyncio.open_connection(*u[len("http://"):].split(":"))
        writer.write(raw)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        return data

    data, fe = serve(tokenizer, scenario=scenario)
    head, body = data.split(b"\r\n\r\n", 1)
    assert head.split(b" ")[1] == b"400"
    assert json.loads(body)["error"]["type"] == "invalid_request_error" and fe.requests == []
def test_n_choices_and_batches_carry_their_index(tokenizer):
    body = {"model": "tiny", "prompt": ["a", "b"], "n": 2, "seed": 3}
    (status, out, _), fe = serve(tokenizer, scenario=lambda s, u, f: post(
        s, f"{u}/v1/completions", body))
    assert status == 200 and fe.choices == 2
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert [r.prompt_token_ids for r in fe.requests] == [tokenizer.encode("a"),
                                                         tokenizer.encode("b")]
    assert out["usage"]["completion_tokens"] == 8 and out["usage"]["prompt_tokens"] == 6


def test_stream_interleaves_choices_and_counts_usage_continuously(tokenizer):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 2,
            "stream": True, "stream_options": {"include_usage": True,
                                               "continuous_usage_stats": True}}
    events, _ = serve(tokenizer, scenario=lambda s, u, f: post_stream(
        s, f"{u}/v1/chat/completions", body))
    chunks = [json.loads(e) for e in events[:-1]]
    heads = [c["choices"][0] for c in chunks[:2]]
    assert [h["index"] for h in heads] == [0, 1] and all(h["delta"]["role"] for h in heads)
    assert all(c["usage"] is not None for c in chunks)
    by_index = {}
    for c in chunks[2:-1]:
        by_index.setdefault(c["choices"][0]["index"], []).append(c["usage"]["completion_tokens"])
    assert by_index == {0: [1, 2], 1: [1, 2]}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


def test_tokenize_detokenize_version_and_models(tokenizer):
    async def scenario(s, u, f):
        got = {}
        got["tok"] = await post(s, f"{u}/tokenize", {"model": "tiny", "prompt": "hello",
                                                     "return_token_strs": True})
        got["chat"] = await post(s, f"{u}/tokenize", {"messages": [
            {"role": "user", "content": "hi"}], "add_generation_prompt": True})
        ids = got["tok"][1]["tokens"]
        got["detok"] = await post(s, f"{u}/detokenize", {"model": "tiny", "tokens": ids})
        got["bad"] = await post(s, f"{u}/detokenize", {"tokens": [99999]})
        for path in ("/version", "/load", "/ping"):
            async with s.get(u + path) as r:
                got[path] = (r.status, await r.json())
        return got

    got, _ = serve(tokenizer, scenario=scenario)
    status, tok, _ = got["tok"]
    assert status == 200 and tok["tokens"] == tokenizer.encode("hello")
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == MODEL.max_model_len
    assert tok["token_strs"] == tokenizer.convert_ids_to_tokens(tok["tokens"])
    chat = got["chat"][1]
    assert chat["tokens"] == tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    assert chat["token_strs"] is None
    assert got["detok"][1] == {"prompt": tokenizer.decode(tok["tokens"],
                                                          skip_special_tokens=False)}
    assert got["bad"][0] == 400
    assert got["/version"][0] == 200 and "version" in got["/version"][1]
    assert got["/load"] == (200, {"server_load": 0})
    assert got["/ping"][0] == 200


def test_unknown_fields_are_accepted(tokenizer):
    body = {"model": "tiny", "prompt": "x", "not_a_field": [1], "skip_special_tokens": False,
            "stream": False}
    (status, _, _), fe = serve(tokenizer, scenario=lambda s, u, f: post(
        s, f"{u}/v1/completions", body))
    assert status == 200 and fe.requests[0].skip_special_tokens is False
