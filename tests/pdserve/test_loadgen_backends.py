"""The OpenAI backend and the `pdserve bench` CLI against a scripted SSE server (no cluster)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import pytest
from aiohttp import web

from pdserve.cli import main as pdserve_main
from pdserve.loadgen.backend import SendOptions
from pdserve.loadgen.datasets import BenchRequest
from pdserve.loadgen.openai_backend import OpenAIBackend
from pdserve.loadgen.report import check_report

# The first prompt id picks the scripted behaviour.
OK, REFUSED, ERROR_MID_STREAM, NO_FINISH = 10, 1001, 1002, 1003  # ids the CLI never draws


def _event(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _choice(text, finish=None):
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}], "usage": None}


class ScriptedServer:
    """An aiohttp server on its own thread and loop, answering /v1 like the router does."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.auth: list[str | None] = []
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> ScriptedServer:
        self._thread.start()
        assert self._started.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        sock = socket.create_server(("127.0.0.1", 0))
        self._loop.run_until_complete(web.SockSite(self._runner, sock).start())
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
        self._started.set()
        self._loop.run_forever()

    async def _models(self, request):
        return web.json_response({"object": "list", "data": [{"id": "m", "max_model_len": 64}]})

    async def _completions(self, request):
        body = await request.json()
        self.bodies.append(body)
        self.auth.append(request.headers.get("Authorization"))
        first = body["prompt"][0]
        if first == REFUSED:
            return web.json_response({"error": {"message": "busy", "type": "rate_limit_error",
                                                "param": None, "code": "resource_exhausted"}},
                                     status=429)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = body["max_tokens"]
        for i in range(n - 1):  # the last token's text is held back: it comes with the finish
            await resp.write(_event(_choice(f"t{i}")))
            if first == ERROR_MID_STREAM:
                await resp.write(_event({"error": {"message": "gone", "code": "unavailable"}}))
                break
        else:
            if first != NO_FINISH:
                await resp.write(_event(_choice("", "length")))
                await resp.write(_event({"choices": [], "usage": {
                    "prompt_tokens": len(body["prompt"]), "completion_tokens": n,
                    "prompt_tokens_details": {"cached_tokens": 2}}}))
        await resp.write(b"data: [DONE]\n\n")
        return resp


@pytest.fixture(scope="module")
def server():
    with ScriptedServer() as s:
        yield s


async def _send_all(url, requests, **options):
    backend = OpenAIBackend(url, SendOptions(**options))
    try:
        info = await backend.server_info()
        return info, [await backend.send(r) for r in requests]
    finally:
        await backend.close()


def test_openai_backend_records_events_usage_and_errors(server):
    reqs = [BenchRequest((OK, 5, 6), 4, "a"), BenchRequest((REFUSED, 5), 4, "a"),
            BenchRequest((ERROR_MID_STREAM, 5), 4, "a"), BenchRequest((NO_FINISH, 5), 4, "a")]
    info, (ok, refused, mid, unfinished) = asyncio.run(
        _send_all(server.url, reqs, token="sekret", temperature=0.5))
    assert (info.model, info.max_model_len) == ("m", 64)
    body = server.bodies[-4]
    assert body["prompt"] == [OK, 5, 6] and body["max_tokens"] == 4 and body["model"] == "m"
    assert body["stream"] and body["ignore_eos"] and body["stream_options"]["include_usage"]
    assert body["temperature"] == 0.5 and server.auth[-4] == "Bearer sekret"
    assert ok.ok and len(ok.arrivals) == 3 and ok.output_tokens == 4 and ok.cached_tokens == 2
    assert refused.error == "RESOURCE_EXHAUSTED" and refused.error_detail == "busy"
    assert not refused.ok
    assert (mid.error, mid.error_detail) == ("UNAVAILABLE", "gone")
    assert unfinished.error == "INCOMPLETE_STREAM"


def test_bench_cli_against_the_openai_api_writes_a_report(server, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = pdserve_main(["bench", "--openai-url", server.url, "--num-prompts", "5",
                       "--input-len", "6", "--output-len", "3", "--vocab-size", "5",
                       "--goodput", "ttft:60000", "--output", str(out), "--no-progress"])
    assert rc == 0
    data = json.loads(out.read_text())
    check_report(data)
    assert data["summary"]["completed"] == 5 and data["summary"]["output_tokens"] == 15
    assert data["config"]["server_model"] == "m" and "token" not in data["config"]
    assert "TTFT" in capsys.readouterr().out


def test_bench_cli_refuses_requests_longer_than_the_context(server, capsys):
    rc = pdserve_main(["bench", "--openai-url", server.url, "--num-prompts", "2",
                       "--input-len", "70", "--output-len", "3", "--no-progress"])
    assert rc == 2
    assert "context is 64" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--dataset", "random", "--num-prefixes", "3"], "--num-prefixes"),
    (["--burstiness", "2"], "burstiness"),
    (["--goodput", "ttft"], "goodput"),
    (["--concurrency", "0"], "concurrency"),
    (["--num-prompts", "0"], "num_prompts"),
])
def test_bench_cli_names_the_bad_flag(flags, message, capsys):
    assert pdserve_main(["bench", "--target", "127.0.0.1:9", *flags]) == 2
    assert message in capsys.readouterr().err


def test_grpc_backend_records_the_status_and_message_of_a_failure():
    from pdserve.loadgen.grpc_backend import GrpcBackend

    async def send():
        backend = GrpcBackend("127.0.0.1:9", SendOptions(timeout_s=30))
        try:
            return await backend.send(BenchRequest((1, 2, 3), 2, "a"))
        finally:
            await backend.close()

    r = asyncio.run(send())
    assert r.error == "UNAVAILABLE" and r.error_detail and not r.ok and r.arrivals == ()


def test_bench_cli_reports_an_unreachable_server(capsys):
    rc = pdserve_main(["bench", "--target", "127.0.0.1:9", "--num-prompts", "1",
                       "--no-progress"])
    assert rc == 1
    assert "cannot reach the server" in capsys.readouterr().err
