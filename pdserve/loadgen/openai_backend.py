"""`OpenAIBackend`: benchmark requests through an OpenAI-compatible `/v1/completions` (SSE).

Prompts go as token-id arrays, with `stream`, `ignore_eos` and `stream_options.include_usage`.
An SSE event carries text, not token ids, so each event with non-empty text counts as one
arrival of one token; the output token count comes from the final usage. When the server holds
a token back (an incomplete UTF-8 character), its text rides in a later event: ITL samples over
HTTP are then per event, while TPOT still divides by the exact token count.

Failures: an HTTP error status becomes the error body's `code` upper-cased
("RESOURCE_EXHAUSTED"), else `HTTP_<status>`; an error event mid-stream likewise; a stream that
ends without a finish reason is `INCOMPLETE_STREAM`.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp

from pdserve.loadgen.backend import SendOptions, ServerInfo
from pdserve.loadgen.datasets import BenchRequest
from pdserve.loadgen.records import Recorder, RequestResult


class OpenAIBackend:
    def __init__(self, base_url: str, options: SendOptions) -> None:
        """base_url is the API root, e.g. "http://127.0.0.1:8000/v1"."""
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"openai_url: expected http(s)://host:port/v1, got {base_url!r}")
        self._base = base_url.rstrip("/")
        self._options = options
        self._model = options.model
        self._session: aiohttp.ClientSession | None = None

    async def server_info(self) -> ServerInfo:
        async with self._http().get(f"{self._base}/models") as resp:
            if resp.status != 200:
                raise RuntimeError(f"GET {self._base}/models answered HTTP {resp.status}")
            models = (await resp.json())["data"]
        card = next((m for m in models if m["id"] == self._model), models[0])
        self._model = card["id"]  # the HTTP API wants the model named
        return ServerInfo(card["id"], int(card.get("max_model_len") or 0))

    async def send(self, request: BenchRequest) -> RequestResult:
        body = {"model": self._model, "prompt": list(request.prompt),
                "max_tokens": request.output_len, "temperature": self._options.temperature,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        rec = Recorder(request.kind, len(request.prompt))
        try:
            async with self._http().post(f"{self._base}/completions", json=body) as resp:
                if resp.status != 200:
                    rec.fail(*_error_status(resp.status, await resp.read()))
                else:
                    await _read_events(resp, rec)
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            rec.fail("CLIENT_TIMEOUT", f"no answer within {self._options.timeout_s:g}s")
        except Exception as exc:  # noqa: BLE001 - any other failure is this request's result
            rec.fail(type(exc).__name__, str(exc))
        return rec.result()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        """The session, created in the running loop on first use."""
        if self._session is None:
            headers = {}
            if self._options.token:
                headers["Authorization"] = f"Bearer {self._options.token}"
            self._session = aiohttp.ClientSession(
                headers=headers, timeout=aiohttp.ClientTimeout(total=self._options.timeout_s),
                # the runner bounds concurrency
                connector=aiohttp.TCPConnector(
                    limit=0, ssl=(self._options.tls.ssl_context() if self._options.tls
                                  else True)))
        return self._session


async def _read_events(resp: aiohttp.ClientResponse, rec: Recorder) -> None:
    finished = False
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        event = json.loads(data)
        if "error" in event:
            rec.fail(*_status_name(event["error"], "STREAM_ERROR"))
            return
        for choice in event.get("choices") or ():
            if choice.get("text"):
                rec.tokens(1)
            finished = finished or choice.get("finish_reason") is not None
        usage = event.get("usage")
        if usage:
            rec.usage_tokens = int(usage["completion_tokens"])
            details = usage.get("prompt_tokens_details") or {}
            rec.cached_tokens = details.get("cached_tokens")
    if not finished:
        rec.fail("INCOMPLETE_STREAM", "the stream ended without a finish reason")


def _error_status(status: int, body: bytes) -> tuple[str, str]:
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        error = {"message": body[:200].decode(errors="replace")}
    return _status_name(error, f"HTTP_{status}")


def _status_name(error: object, default: str) -> tuple[str, str]:
    """(status name, message) of an OpenAI error object."""
    if not isinstance(error, dict):
        return default, str(error)
    code = error.get("code")
    return (str(code).upper() if code else default), str(error.get("message") or "")
