"""The OpenAI-compatible HTTP server (aiohttp), on the router's asyncio loop.

Owns the routes, bearer-token auth (the same tokens as the gRPC API; `/health` stays open), the
body size limit and read timeouts, and turning every failure into an OpenAI error body:
`ApiError`s, validation `RequestError`s, aiohttp's own HTTP errors (unknown route, wrong
method, body too large; malformed HTTP in `connection.py`) and, as a 500, anything
unexpected.

Slow clients: a connection whose first request line and headers are not all there within
`header_timeout_s` of it opening is answered 408 and closed (`connection.HeadTimeout`; a
kept-alive connection short of its next head is closed `2 × header_timeout_s` after its last
response); a body not all there within `body_timeout_s` of the headers is a 408
(`body.read_json`).

    GET  /health                 200 while a decode worker takes requests, else 503
    GET  /metrics                Prometheus text format (when the router passes a registry)
    GET  /v1/models[/{model}]
    POST /v1/completions
    POST /v1/chat/completions
    POST /v1/chat/completions/batch   vLLM's: one choice per conversation (chat_batch.py)
    POST /tokenize, /detokenize  vLLM's tokenizer endpoints (info.py)
    GET  /version, /load, /ping, /tokenizer_info;  POST /invocations (SageMaker)
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from pdserve.serving.security.http_auth import bearer_ok
from router.frontend import Frontend
from router.openai import chat, chat_batch, completions, info, sse
from router.openai.body import BodyLimits
from router.openai.connection import connection_protocol
from router.openai.errors import (
    ApiError,
    RequestError,
    bad_request,
    model_not_found,
    unauthenticated,
)
from router.openai.generation import ApiContext
from router.openai.responses import model_json, models_json
from router.openai.schemas import IgnoredFields, ServedModel
from router.openai.tools import ToolConfig

log = logging.getLogger(__name__)

# /health, /ping and /version stay open (probes); /metrics checks its own tokens
# (`HttpConfig.metrics_tokens`).
_OPEN_PATHS = frozenset({"/health", "/metrics", "/ping", "/version"})


@dataclass(frozen=True)
class ApiOptions:
    """vLLM's server flags that change what the OpenAI API answers."""

    tools: ToolConfig = ToolConfig()
    """--tool-call-parser / --enable-auto-tool-choice."""
    prompt_tokens_details: bool = False
    """--enable-prompt-tokens-details: usage reports cached prompt tokens."""
    tokens_as_ids: bool = False
    """--return-tokens-as-token-ids: every request's logprobs name tokens "token_id:N"."""
    force_include_usage: bool = False
    """--enable-force-include-usage: every stream carries usage, on each chunk and at the
    end, whatever its stream_options."""
    max_logprobs: int = 20
    """--max-logprobs: most top logprobs one request may ask for (the router passes it to
    `ServedModel.max_logprobs`)."""


@dataclass(frozen=True)
class HttpConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    """0 binds any free port (read the real one from `OpenAIServer.address`)."""
    max_body_bytes: int = 4 * 1024 * 1024
    """Larger request bodies are refused with 413 (the router sets it from `RequestLimits`)."""
    header_timeout_s: float = 10.0
    """Longest wait for a request's line and headers (408)."""
    body_timeout_s: float = 30.0
    """Longest wait for a request's body once its headers are in (408)."""
    auth_tokens: tuple[str, ...] = field(default=(), repr=False)
    """Bearer tokens accepted (empty = no auth); the router passes the gRPC API's tokens."""
    metrics_tokens: tuple[str, ...] = field(default=(), repr=False)
    """Bearer tokens for `/metrics` (empty = `auth_tokens`: metrics follow the API's auth)."""
    ssl_context: ssl.SSLContext | None = field(default=None, compare=False)
    """TLS (None = plaintext HTTP); one that requires client certificates makes it mTLS."""
    api: ApiOptions = ApiOptions()
    """What the API answers (vLLM's server flags)."""
    root_path: str = ""
    """vLLM's --root-path: every route also answers under this prefix (behind a proxy that
    forwards /PREFIX/v1/... unchanged)."""


class OpenAIServer:
    def __init__(self, frontend: Frontend, model: ServedModel, config: HttpConfig,
                 healthy: Callable[[], bool], metrics: CollectorRegistry | None = None,
                 before_scrape: Callable[[], Awaitable[None]] | None = None) -> None:
        self.ctx = ApiContext(frontend, model, config.api.tools, IgnoredFields(log),
                              config.api.prompt_tokens_details,
                              BodyLimits(config.max_body_bytes, config.body_timeout_s),
                              config.api.tokens_as_ids, config.api.force_include_usage)
        self.config = config
        self.healthy = healthy
        self.metrics = metrics
        self.before_scrape = before_scrape  # refreshes what the collectors read
        self._runner: web.AppRunner | None = None
        self._site: asyncio.Server | None = None
        self.address = ""
        """host:port once started."""

    def app(self) -> web.Application:
        root = self.config.root_path.rstrip("/")
        app = web.Application(client_max_size=self.config.max_body_bytes,
                              middlewares=[_errors, _auth(self.config.auth_tokens, root)])
        for prefix in ("", root) if root else ("",):
            for method, path, handler in self._routes():
                app.router.add_route(method, prefix + path, handler)
        return app

    def _routes(self) -> list[tuple[str, str, Callable]]:
        bind = functools.partial
        routes = [("GET", "/health", self._health), ("GET", "/v1/models", self._models),
                  ("GET", "/v1/models/{model}", self._model),
                  ("POST", "/v1/completions", self._completions),
                  ("POST", "/v1/chat/completions", self._chat),
                  ("POST", "/v1/chat/completions/batch", bind(chat_batch.handle, ctx=self.ctx)),
                  ("POST", "/tokenize", bind(info.tokenize, ctx=self.ctx)),
                  ("POST", "/detokenize", bind(info.detokenize, ctx=self.ctx)),
                  ("GET", "/tokenizer_info", bind(info.tokenizer_info, ctx=self.ctx)),
                  ("POST", "/invocations", bind(info.invocations, ctx=self.ctx)),
                  ("GET", "/load", self._load), ("GET", "/version", self._version),
                  ("GET", "/ping", self._health), ("POST", "/ping", self._health)]
        if self.metrics is not None:
            routes.append(("GET", "/metrics", self._metrics))
        return routes

    async def start(self) -> str:
        # handler_cancellation: a client that disconnects cancels its handler, which cancels
        # the request on the workers even while no token is being written.
        # keepalive_timeout: aiohttp closes a connection idle (or stuck in a request's head)
        # that long after its last response; HeadTimeout answers the head's 408 before that.
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None,
                                    shutdown_timeout=2.0,
                                    keepalive_timeout=2 * self.config.header_timeout_s)
        await self._runner.setup()
        server = self._runner.server
        assert server is not None
        timeout = self.config.header_timeout_s
        # Our own listener instead of web.TCPSite: every connection's protocol is wrapped in
        # HeadTimeout. TLS wraps the transport below it, so the timer sees plaintext.
        self._site = await asyncio.get_running_loop().create_server(
            lambda: connection_protocol(server, timeout), self.config.host, self.config.port,
            ssl=self.config.ssl_context, reuse_address=True)
        port = self._site.sockets[0].getsockname()[1]
        self.address = f"{self.config.host}:{port}"
        return self.address

    async def stop(self) -> None:
        if self._site is not None:
            self._site.close()  # no new connections; open ones end in the runner's cleanup
            self._site = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await completions.handle(request, self.ctx)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await chat.handle(request, self.ctx)

    async def _health(self, request: web.Request) -> web.Response:
        ok = self.healthy()
        return web.json_response({"status": "ok" if ok else "unavailable"},
                                 status=200 if ok else 503)

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": info.version()})

    async def _load(self, request: web.Request) -> web.Response:
        return info.load(self.ctx)

    async def _metrics(self, request: web.Request) -> web.Response:
        assert self.metrics is not None
        if not bearer_ok(request.headers.get("Authorization"),
                         self.config.metrics_tokens or self.config.auth_tokens):
            raise unauthenticated()
        if self.before_scrape is not None:
            await self.before_scrape()
        return web.Response(body=generate_latest(self.metrics),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(models_json(self.ctx.model), dumps=sse.dumps)

    async def _model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name not in self.ctx.model.names:
            raise model_not_found(name, self.ctx.model.id)
        return web.json_response(model_json(self.ctx.model, name), dumps=sse.dumps)


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        if exc.status == 408:
            return await _close_after(request, _error_response(exc))
        return _error_response(exc)
    except RequestError as exc:
        return _error_response(bad_request(exc))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        type_ = "not_found_error" if exc.status == 404 else "invalid_request_error"
        return _error_response(ApiError(exc.status, _http_message(request, exc), type_))
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        return _error_response(ApiError(500, "internal server error", "server_error"))


def _auth(tokens: Sequence[str], root: str = ""):
    expected = [t.encode() for t in tokens]

    @web.middleware
    async def check(request: web.Request, handler) -> web.StreamResponse:
        path = request.path
        if root and path.startswith(root + "/"):
            path = path[len(root):]
        if expected and path not in _OPEN_PATHS:
            header = request.headers.get("Authorization", "")
            given = header[7:].strip().encode() if header[:7].lower() == "bearer " else b""
            if not any(hmac.compare_digest(given, t) for t in expected):
                raise unauthenticated()
        return await handler(request)

    return check


async def _close_after(request: web.Request, resp: web.Response) -> web.Response:
    """Send `resp`, then close the connection. A client whose body stalled gets its 408 and
    loses the connection at once; otherwise aiohttp would keep it up to 10 s more, reading the
    rest of a body nobody will use. Closing the transport flushes what was written first."""
    resp.force_close()  # Connection: close
    await resp.prepare(request)
    await resp.write_eof()
    request.protocol.force_close()
    return resp


def _error_response(exc: ApiError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status, dumps=sse.dumps,
                             headers=exc.headers)


def _http_message(request: web.Request, exc: web.HTTPException) -> str:
    if exc.status == 404:
        return f"no route {request.method} {request.path}"
    if exc.status == 405:
        return f"method {request.method} is not allowed on {request.path}"
    return exc.text or exc.reason or f"HTTP {exc.status}"
