"""`python -m router [--model PATH] (--decode H:P[,H:P] [--prefill H:P[,H:P]] | --redis URL)
[--port 50051] [--http-port 8000]`: the gRPC API and, on the same asyncio loop, the OpenAI
HTTP API.

Two ways to know the workers:
- static lists (`--prefill`, `--decode`): fixed pools, the default without Redis. With
  `--redis` as well, the workers' cached blocks come from the Redis KV index.
- discovery (`--redis URL` and no lists): the pools follow the index's worker registry
  (`router.membership`): workers started later with the same `--redis` join on their own, and
  leave when they stop. The router may start before any worker: requests get UNAVAILABLE
  until a decode worker joins. The model id (`--model-id`, else the checkpoint's default: a
  directory's name, a .gguf file's stem) must be the workers' own; the length limit comes
  from the checkpoint config.

With static lists the router serves as soon as each pool has one healthy worker (at most
`--start-wait` seconds after it starts; then it serves anyway, with UNAVAILABLE until a
decode worker answers).

SIGTERM (or SIGINT) stops it gracefully (`shutdown`): new requests get UNAVAILABLE (clients
retry elsewhere), health reports NOT_SERVING (gRPC) / 503 (HTTP), and the streams in flight
finish within `--shutdown-grace` seconds; what is left then is cancelled.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path

from kv_store.index import KVIndex, KVIndexConfigError, PrefixIndex, create_index
from pdserve.default_model import ensure_default_model
from pdserve.engine.checkpoint import Checkpoint, open_checkpoint
from pdserve.engine.sampling_params import MAX_LOGPROBS
from pdserve.observability.http import MetricsServer
from pdserve.observability.logs import configure_logging
from pdserve.observability.router_metrics import RouterMetrics
from pdserve.observability.vllm_metrics import ClusterCollector, ClusterState
from pdserve.proto import pb
from pdserve.serving.grpc_server import start_server
from pdserve.serving.ready import announce_ready, wait_for_signal
from pdserve.serving.security import ClientSecurity, TLSError
from pdserve.serving.security import args as security_args
from pdserve.serving.worker_options import REDIS_CA_ENV, REDIS_URL_ENV
from router.admission import AdmissionConfig
from router.auth import BearerAuthInterceptor
from router.config import RouterConfig
from router.frontend import FinishRules, Frontend
from router.membership import Membership
from router.openai import HttpConfig, OpenAIServer, ServedModel
from router.openai.server import ApiOptions
from router.openai.tool_parsers import PARSERS
from router.openai.tools import ToolConfig
from router.pool import WorkerPool
from router.service import PDServeService
from router.validation import RequestLimits

log = logging.getLogger("router")

# LLMEngine's default cap on max_model_len (pdserve/engine/engine.py): what a worker started
# without --max-model-len accepts.
ENGINE_MAX_LEN_CAP = 32768


async def open_index(redis_url: str, redis_ca: str = "") -> KVIndex | None:
    """The started Redis KV index to follow (None without a URL); bad credentials end the
    process with a message that hides the password."""
    if not redis_url:
        return None
    from kv_store.index.redis_common import check_url, masked_url  # redis only when used

    try:
        index = create_index(check_url(redis_url), follow=True, tls_ca=redis_ca)
        await index.start()
    except KVIndexConfigError as exc:
        raise SystemExit(f"router: --redis: {exc}") from None
    log.info("KV index: following %s", masked_url(redis_url))
    return index


async def serve(cfg: RouterConfig, http_cfg: HttpConfig | None) -> None:
    index = await open_index(cfg.redis_url, cfg.redis_ca)
    checkpoint = open_checkpoint(cfg.model)
    tokenizer = checkpoint.tokenizer()
    if cfg.chat_template:
        tokenizer = tokenizer.with_chat_template(cfg.chat_template)
    model_cfg = checkpoint.model_config
    prefill, decode = make_pools(cfg, index)
    await asyncio.gather(prefill.start(), decode.start())
    membership = None
    if cfg.discover:
        model_id, max_len = served_model(cfg, checkpoint, [])
        membership = Membership(index, {"prefill": prefill, "decode": decode}, model_id,
                                max_len, cfg.discovery_period_s)
        await membership.start()
        if not await membership.settle(cfg.discovery_wait_s):
            log.info("discovery: starting with %d prefill and %d decode workers answering",
                     len(prefill.healthy()), len(decode.healthy()))
    else:
        await asyncio.gather(prefill.wait_any_healthy(cfg.start_wait_s),
                             decode.wait_any_healthy(cfg.start_wait_s))
        infos = [w.info for w in decode.workers + prefill.workers if w.info is not None]
        model_id, max_len = served_model(cfg, checkpoint, infos)
    limits = RequestLimits(max_len, model_cfg.vocab_size, tokenizer.max_token_bytes)
    metrics = RouterMetrics(model_name=model_id)
    metrics.registry.register(ClusterCollector(
        model_id, lambda: cluster_state(metrics, prefill, decode)))
    metrics.export_pools(lambda: [(w.role, w.address, w.polls)
                                  for pool in (prefill, decode) for w in pool.workers],
                         decode.prefix.num_blocks)
    rules = FinishRules(checkpoint.eos_token_ids, max_len)
    frontend = Frontend(cfg, tokenizer, prefill, decode, metrics, rules, limits)
    service = PDServeService(frontend, max_len, model_id,
                             ToolConfig(cfg.tool_call_parser, cfg.enable_auto_tool_choice))
    interceptors = [BearerAuthInterceptor(cfg.auth_tokens)] if cfg.auth_tokens else []
    server = await start_server(cfg.host, cfg.port,
                                lambda s: s.add_generic_rpc_handlers((service.handlers(),)),
                                [pb.DESCRIPTOR.services_by_name["PDServe"].full_name],
                                tls=cfg.tls, interceptors=interceptors,
                                max_receive_bytes=limits.max_message_bytes,
                                front=cfg.grpc_front)
    if server.front is not None:
        metrics.export_front_refusals(lambda: server.front.refusals)
    ready = {"role": "router", "address": f"{cfg.host}:{server.port}",
             "discovery": cfg.discover}
    metrics_server = None
    if cfg.metrics_port >= 0:  # a /metrics of its own, off the API's port
        metrics_server = MetricsServer(
            cfg.metrics_host or cfg.host, cfg.metrics_port, metrics.registry,
            cfg.tls.ssl_context() if cfg.tls is not None else None,
            cfg.metrics_tokens or cfg.auth_tokens)
        ready["metrics_address"] = metrics_server.address
    http = None
    if http_cfg is not None:
        served = ServedModel(model_id, max_len, model_cfg.vocab_size, int(time.time()),
                             tokenizer.max_token_bytes, root=cfg.model,
                             aliases=cfg.model_aliases, max_logprobs=http_cfg.api.max_logprobs)
        http = OpenAIServer(frontend, served,
                            dataclasses.replace(http_cfg, max_body_bytes=limits.max_body_bytes),
                            lambda: frontend.accepting and bool(decode.routable()),
                            metrics=metrics.registry if metrics_server is None else None,
                            before_scrape=lambda: refresh_pools(prefill, decode))
        ready["http_address"] = await http.start()
    announce_ready(ready)

    async def cleanup() -> None:
        await shutdown(frontend, server, http, cfg.shutdown_grace_s)
        if metrics_server is not None:
            metrics_server.close()
        if membership is not None:
            await membership.close()
        await asyncio.gather(prefill.close(), decode.close())
        frontend.tokens.close()
        if index is not None:
            await index.close()

    await wait_for_signal(cleanup)


async def shutdown(frontend: Frontend, server, http: OpenAIServer | None,
                   grace_s: float) -> None:
    """Stop taking requests, let the streams in flight finish within `grace_s`, stop."""
    loop = asyncio.get_running_loop()
    end = loop.time() + grace_s
    frontend.accepting = False  # new requests: UNAVAILABLE (retryable elsewhere)
    await server.set_serving(False)
    log.info("shutting down: %d requests in flight, up to %.0fs to finish",
             frontend.inflight, grace_s)
    while frontend.inflight > 0 and loop.time() < end:
        await asyncio.sleep(0.05)
    if frontend.inflight:
        log.warning("shutdown grace over: cancelling %d requests", frontend.inflight)
    if http is not None:
        await http.stop()
    await server.stop(grace=0.5)


def cluster_state(metrics: RouterMetrics, prefill: WorkerPool, decode: WorkerPool
                  ) -> ClusterState:
    """vLLM's engine-state figures for the whole cluster: requests from the router's own
    count (exact, live), KV usage of the decode pool, cache counters of every worker."""
    p, d = prefill.totals(), decode.totals()
    return ClusterState(metrics.running, metrics.waiting, d.kv_blocks_used, d.kv_blocks_total,
                        p.prefix_cache_queries + d.prefix_cache_queries,
                        p.prefix_cache_hits + d.prefix_cache_hits,
                        p.preemptions + d.preemptions, d.block_size)


async def refresh_pools(*pools: WorkerPool) -> None:
    await asyncio.gather(*(pool.refresh_stats() for pool in pools))


def make_pools(cfg: RouterConfig, index: KVIndex | None) -> tuple[WorkerPool, WorkerPool]:
    """The (prefill, decode) pools: the static lists, or empty ones that discovery fills."""
    # One view of every worker's cached blocks, fed by the Redis stream or by their stats.
    prefix = index.prefix if index is not None else PrefixIndex()
    prefill, decode = (WorkerPool(role, addresses, cfg.health_period_s,
                                  cfg.heartbeat_timeout_s, prefix,
                                  events_from_stats=index is None, security=cfg.internal)
                       for role, addresses in (("prefill", cfg.prefill), ("decode", cfg.decode)))
    return prefill, decode


def served_model(cfg: RouterConfig, checkpoint: Checkpoint, infos: list) -> tuple[str, int]:
    """(model id, length limit) the router serves: from the workers' infos when it has them
    (static lists), else from the flags and the checkpoint, as a worker's engine derives them
    by default (discovery, where no worker may exist yet)."""
    model_id = cfg.model_id or (infos[0].model_id if infos else checkpoint.model_id)
    default_len = min(checkpoint.model_config.max_position_embeddings, ENGINE_MAX_LEN_CAP)
    return model_id, min((i.max_model_len for i in infos), default=default_len)


def parse(argv: list[str] | None = None) -> tuple[RouterConfig, HttpConfig | None]:
    """The router's config, and the HTTP server's (None when --http-port is -1)."""
    p = argparse.ArgumentParser(prog="router")
    p.add_argument("--model", default=None,
                   help="HF checkpoint dir, FILE.gguf or a dir holding one (default: the "
                        "embedded SmolLM2-135M-Instruct)")
    p.add_argument("--prefill", default="", help="comma-separated host:port list")
    p.add_argument("--decode", default="",
                   help="comma-separated host:port list (none with --redis: discovery mode)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--no-grpc-front", action="store_true",
                   help="let gRPC's own server own --port (no front refusing oversized "
                        "messages from their length prefix: they are refused ~100 ms later)")
    p.add_argument("--served-model-name", "--model-id", dest="model_id", nargs="+",
                   default=[], metavar="NAME",
                   help="the model's name in requests and responses (more names: aliases); "
                        "default: the workers' (the checkpoint directory's name)")
    p.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                   help="a jinja chat template (a file, or the template itself) replacing "
                        "the model's")
    p.add_argument("--tool-call-parser", choices=PARSERS, default=None,
                   help="how tool calls are found in the model's output with tool_choice "
                        "auto: hermes (<tool_call> JSON, Qwen2.5 / SmolLM2) or llama3_json")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='allow tool_choice "auto" (needs --tool-call-parser)')
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="report usage.prompt_tokens_details.cached_tokens")
    add_vllm_api_args(p)
    p.add_argument("--local-prefill-tokens", type=int, default=32)
    p.add_argument("--routing", choices=("kv", "round-robin"), default="kv",
                   help="worker choice: KV-aware (default) or round-robin (a baseline)")
    p.add_argument("--queue-waves", type=int, default=AdmissionConfig.queue_waves,
                   help="admission: longest queue on a decode worker, in batches of what it "
                        "runs at once")
    p.add_argument("--no-admission", action="store_true",
                   help="admit every request (a baseline for benchmarks)")
    p.add_argument("--shutdown-grace", type=float, default=30.0, metavar="S",
                   help="on SIGTERM, longest wait in seconds for streams in flight to finish "
                        "(default 30)")
    p.add_argument("--start-wait", type=float, default=60.0, metavar="S",
                   help="static lists: longest start-up wait for one healthy worker per pool")
    p.add_argument("--http-port", type=int, default=8000,
                   help="OpenAI HTTP API port (0 = any free port, -1 = no HTTP API)")
    p.add_argument("--http-host", default=None, help="HTTP bind address (default: --host)")
    p.add_argument("--redis", default=os.environ.get(REDIS_URL_ENV, ""), metavar="URL",
                   help="follow the Redis KV index at URL for the workers' cached blocks "
                        f"(redis://:password@host:port/db; default: ${REDIS_URL_ENV}); without "
                        "--prefill/--decode, also discover the workers from its registry")
    p.add_argument("--redis-ca", default=os.environ.get(REDIS_CA_ENV, ""), metavar="FILE",
                   help=f"CA of a rediss:// index server (default: ${REDIS_CA_ENV})")
    p.add_argument("--discover-wait", type=float, default=5.0, metavar="S",
                   help="discovery mode: longest start-up wait for registered workers to answer")
    p.add_argument("--health-period", type=float, default=RouterConfig.health_period_s,
                   metavar="S", help="how often each worker is polled (its heartbeat)")
    p.add_argument("--heartbeat-timeout", type=float,
                   default=RouterConfig.heartbeat_timeout_s, metavar="S",
                   help="a worker silent this long leaves its pool; its requests migrate")
    p.add_argument("--migration-limit", type=int, default=RouterConfig.migration_limit,
                   metavar="N", help="most moves of one request to another worker after a "
                                     "worker failure (0: fail it instead)")
    p.add_argument("--metrics-port", type=int, default=-1,
                   help="serve /metrics on a server of its own at --metrics-host:PORT "
                        "(0 = any free port; default -1: on the HTTP API's port)")
    security_args.add_metrics_args(p)
    security_args.add_tls_args(p)
    security_args.add_internal_tls_args(p)
    security_args.add_secret_args(p)
    a = p.parse_args(argv)
    prefill = tuple(x for x in a.prefill.split(",") if x)
    decode = tuple(x for x in a.decode.split(",") if x)
    if not decode and (prefill or not a.redis):
        p.error("give --decode (and --prefill) host:port lists, or --redis URL alone to "
                "discover the workers from its registry")
    if a.discover_wait < 0:
        p.error("--discover-wait must be >= 0")
    if a.shutdown_grace < 0 or a.start_wait < 0:
        p.error("--shutdown-grace and --start-wait must be >= 0")
    if a.queue_waves < 1:
        p.error("--queue-waves must be >= 1")
    if a.health_period <= 0 or a.heartbeat_timeout <= 0:
        p.error("--health-period and --heartbeat-timeout must be > 0")
    if a.migration_limit < 0:
        p.error("--migration-limit must be >= 0")
    if a.http_port < -1:
        p.error("--http-port must be -1 (disabled), 0 (any free port) or a port number")
    if a.metrics_port < -1 or a.metrics_port > 65535:
        p.error("--metrics-port must be -1 (on the HTTP port), 0 (any free port) or a port")
    if a.enable_auto_tool_choice and not a.tool_call_parser:
        p.error("--enable-auto-tool-choice needs --tool-call-parser")
    tokens = api_tokens(os.environ)
    try:
        tls = security_args.server_tls(a)
        internal = ClientSecurity(security_args.internal_client_tls(a),
                                  security_args.cluster_secret(a))
        metrics_tokens = security_args.metrics_tokens(a)
    except (TLSError, ValueError) as exc:
        p.error(str(exc))
    if not 0 <= a.max_logprobs:
        p.error("--max-logprobs must be >= 0")
    if a.max_logprobs > MAX_LOGPROBS:
        log.warning("--max-logprobs %d: the engine returns at most %d; using %d",
                    a.max_logprobs, MAX_LOGPROBS, MAX_LOGPROBS)
    if a.root_path and not a.root_path.startswith("/"):
        p.error("--root-path must start with /")
    api = ApiOptions(ToolConfig(a.tool_call_parser, a.enable_auto_tool_choice),
                     a.enable_prompt_tokens_details, a.return_tokens_as_token_ids,
                     a.enable_force_include_usage, min(a.max_logprobs, MAX_LOGPROBS))
    http = None if a.http_port == -1 else HttpConfig(
        host=a.http_host or a.host, port=a.http_port, auth_tokens=tokens,
        root_path=a.root_path,
        metrics_tokens=metrics_tokens,
        ssl_context=tls.ssl_context() if tls is not None else None, api=api)
    return RouterConfig(
        model=a.model or str(ensure_default_model()), prefill=prefill, decode=decode,
        host=a.host, port=a.port, grpc_front=not a.no_grpc_front,
        model_id=a.model_id[0] if a.model_id else "", model_aliases=tuple(a.model_id[1:]),
        chat_template=read_chat_template(a.chat_template),
        tool_call_parser=a.tool_call_parser, enable_auto_tool_choice=a.enable_auto_tool_choice,
        local_prefill_tokens=a.local_prefill_tokens, routing=a.routing,
        admission=AdmissionConfig(queue_waves=a.queue_waves, enabled=not a.no_admission),
        shutdown_grace_s=a.shutdown_grace, start_wait_s=a.start_wait,
        auth_tokens=tokens, redis_url=a.redis, redis_ca=a.redis_ca,
        discovery_wait_s=a.discover_wait, health_period_s=a.health_period,
        heartbeat_timeout_s=a.heartbeat_timeout, migration_limit=a.migration_limit, tls=tls,
        internal=internal, metrics_host=a.metrics_host, metrics_port=a.metrics_port,
        metrics_tokens=metrics_tokens), http


def add_vllm_api_args(p: argparse.ArgumentParser) -> None:
    """vLLM's server flags that change what the OpenAI API answers (beside the tool and
    template ones); `pdserve up` passes the same names through."""
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help='logprobs name every token "token_id:N" (as the request field does)')
    p.add_argument("--enable-force-include-usage", action="store_true",
                   help="every stream carries usage: on each chunk, and a last usage chunk")
    p.add_argument("--max-logprobs", type=int, default=MAX_LOGPROBS, metavar="N",
                   help=f"most logprobs / top_logprobs / prompt_logprobs a request may ask "
                        f"for (at most {MAX_LOGPROBS})")
    p.add_argument("--root-path", default="", metavar="/PREFIX",
                   help="also serve every route under this prefix (behind a path-forwarding "
                        "proxy), as vLLM's --root-path")


def api_tokens(env: Mapping[str, str]) -> tuple[str, ...]:
    """The public API's bearer tokens: $PDSERVE_AUTH_TOKENS (comma-separated) and vLLM's
    $VLLM_API_KEY."""
    tokens = [t for t in env.get("PDSERVE_AUTH_TOKENS", "").split(",") if t]
    if env.get("VLLM_API_KEY"):
        tokens.append(env["VLLM_API_KEY"])
    return tuple(dict.fromkeys(tokens))


def read_chat_template(value: str | None) -> str:
    """vLLM's --chat-template: a file's contents, else the value itself as a template."""
    if not value:
        return ""
    path = Path(value)
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{" not in value:
        raise SystemExit(f"router: --chat-template {value!r} is neither a file nor a template")
    return value


def main(argv: list[str] | None = None) -> None:
    configure_logging("router", "", os.environ)
    asyncio.run(serve(*parse(argv)))


if __name__ == "__main__":
    main()
