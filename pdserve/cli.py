"""The `pdserve` command: one entry point for every role.

    pdserve up [MODEL | --model PATH] [--host H] [--port P] [--http-port P] [--prefill N]
               [--decode M] [--redis URL] [--tls auto] [vLLM's engine and server flags:
               --dtype, --max-model-len, --quantization, --served-model-name, ...]
    pdserve generate [--target HOST:PORT] [--tls-ca CA.pem] "prompt"
    pdserve bench [--target HOST:PORT | --openai-url URL] [--num-prompts N] ...  (load generator)
    pdserve demo-model DIR
    pdserve ray up|status|scale|logs|down ...   (a Ray deployment: pdserve/deploy/cli.py)
    pdserve router|prefill-worker|decode-worker ...   (one process of a role)

PATH is a Hugging Face checkpoint directory, a .gguf file or a directory holding one; without
--model every role serves the embedded default, SmolLM2-135M-Instruct (pdserve/default_model.py).

`pdserve up` supervises its processes: a worker (or the router) that exits is started again,
with backoff, on the same ports, while the rest keep serving; Ctrl-C / SIGTERM stops
everything (the router finishes its streams within --shutdown-grace, workers theirs within
--drain-timeout).

With `--redis URL`, `pdserve up` starts the router in discovery mode: its pools follow the
workers registered in Redis, so a worker started later joins the running cluster on its own,
and leaves it (after finishing its requests) on SIGTERM:

    pdserve decode-worker --model DIR --redis URL      (or $PDSERVE_REDIS_URL; --model-id must
    pdserve prefill-worker --model DIR --redis URL      match the router's, if either sets one)
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    roles = {"router": "router.__main__", "prefill-worker": "prefill_worker.__main__",
             "decode-worker": "decode_worker.__main__"}
    if argv and argv[0] in roles:
        import importlib

        importlib.import_module(roles[argv[0]]).main(argv[1:])
        return 0
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    _add_up(sub.add_parser("up", help="start a local cluster"))
    _add_generate(sub.add_parser("generate", help="stream a completion"))
    _add_bench(sub.add_parser("bench", help="serving load generator (pdserve.loadgen)"))
    demo = sub.add_parser("demo-model", help="write the random demo checkpoint (for tests)")
    demo.add_argument("dir")
    demo.add_argument("--seed", type=int, default=0)
    _add_ray(sub.add_parser("ray", help="deploy on a Ray cluster: up | status | scale | logs | "
                                        "down"))
    a = parser.parse_args(argv)
    return {"up": cmd_up, "generate": cmd_generate, "bench": cmd_bench,
            "demo-model": cmd_demo_model, "ray": cmd_ray}[a.cmd](a)


# vLLM flags `pdserve up` accepts so that a vLLM command line starts as it is; each does
# nothing here (name -> takes a value).
VLLM_NO_OPS = {"--enforce-eager": False, "--trust-remote-code": False,
               "--disable-log-requests": False, "--disable-log-stats": False,
               "--enable-chunked-prefill": False, "--disable-frontend-multiprocessing": False,
               "--enable-tokenizer-info-endpoint": False,
               "--enable-server-load-tracking": False, "--gpu-memory-utilization": True,
               "--swap-space": True, "--seed": True, "--tokenizer-mode": True,
               "--disable-uvicorn-access-log": False, "--uvicorn-log-level": True,
               "--enable-log-requests": False, "--disable-fastapi-docs": False}


def _add_up(p: argparse.ArgumentParser) -> None:
    from pdserve.serving.worker_options import add_engine_args

    p.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                   help="the model, as vLLM takes it (the same as --model)")
    p.add_argument("--model", default=None,
                   help="HF checkpoint dir, FILE.gguf or a dir holding one (default: the "
                        "embedded SmolLM2-135M-Instruct, prepared into the cache on first use)")
    p.add_argument("--host", default="127.0.0.1", help="address every server binds to")
    p.add_argument("--port", type=int, default=50051, help="the router's gRPC port")
    p.add_argument("--http-port", type=int, default=8000,
                   help="OpenAI-compatible HTTP API port (0 = any free port, -1 = none)")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers")
    p.add_argument("--decode", type=int, default=1, help="decode workers")
    p.add_argument("--prefill-tp", type=int, default=1, help="TP ranks per prefill worker")
    p.add_argument("--decode-tp", type=int, default=1, help="TP ranks per decode worker")
    p.add_argument("--threads-per-worker", type=int, default=0,
                   help="torch threads per worker rank (0 = cores / ranks)")
    p.add_argument("--local-prefill-tokens", type=int, default=32,
                   help="uncached prompts up to this many tokens are prefilled by the decode "
                        "worker itself")
    p.add_argument("--migration-limit", type=int, default=3,
                   help="most moves of one request to another worker after a worker fails it")
    p.add_argument("--heartbeat-timeout", type=float, default=3.0, metavar="S",
                   help="a worker silent this long leaves its pool; its requests move on")
    p.add_argument("--log-dir", default=None, help="write each process's log here")
    p.add_argument("--worker-arg", action="append", default=[],
                   help="extra flag for every worker (repeatable): --worker-arg=--dtype=bfloat16")
    p.add_argument("--kv-host-gb", type=float, default=0.0,
                   help="host-memory KV tier per worker, GiB (0 = off)")
    p.add_argument("--kv-ssd-dir", default=None,
                   help="SSD KV tier directory (each worker uses DIR/<worker id>)")
    p.add_argument("--kv-ssd-gb", type=float, default=0.0, help="SSD KV tier per worker, GiB")
    p.add_argument("--kv-transport", choices=("nixl", "nccl", "gloo"), default=None,
                   help="what carries KV between workers: nixl (the workers' default; gloo "
                        "where NIXL does not load), nccl (CUDA KV) or gloo")
    p.add_argument("--kv-nixl-reads", action=argparse.BooleanOptionalAction, default=None,
                   help="with NIXL, decode workers read KV from the prefill worker's staging "
                        "slots when on its host (the workers' default); --no-kv-nixl-reads: "
                        "it is written into their landing pools, as across hosts")
    p.add_argument("--shutdown-grace", type=float, default=30.0, metavar="S",
                   help="on stop, seconds the router lets streams in flight finish")
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                   help="on stop, seconds each worker lets its requests finish")
    # The name of worker_options.REDIS_URL_ENV, spelled out: the CLI imports nothing heavy.
    p.add_argument("--redis", default=os.environ.get("PDSERVE_REDIS_URL", ""), metavar="URL",
                   help="Redis KV index for the router and workers, redis://:password@host:port/db "
                        "(default: $PDSERVE_REDIS_URL, else the in-process index); the router "
                        "then discovers workers there, so workers started later join")
    eng = p.add_argument_group("engine (vLLM's flags, passed to every worker)")
    add_engine_args(eng, defaults=False)
    eng.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                     help="TP ranks of every worker (sets --prefill-tp and --decode-tp)")
    api = p.add_argument_group("OpenAI API (vLLM's flags, passed to the router)")
    api.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                     help="a jinja chat template (file or text) replacing the model's")
    api.add_argument("--tool-call-parser", choices=("hermes", "llama3_json"), default=None,
                     help="how tool calls are parsed from the output with tool_choice auto")
    api.add_argument("--enable-auto-tool-choice", action="store_true",
                     help='allow tool_choice "auto" (needs --tool-call-parser)')
    api.add_argument("--enable-prompt-tokens-details", action="store_true",
                     help="report usage.prompt_tokens_details.cached_tokens")
    api.add_argument("--return-tokens-as-token-ids", action="store_true",
                     help='logprobs name every token "token_id:N"')
    api.add_argument("--enable-force-include-usage", action="store_true",
                     help="every stream carries usage, on each chunk and at its end")
    api.add_argument("--max-logprobs", type=int, default=None, metavar="N",
                     help="most logprobs a request may ask for (default and most: 20)")
    api.add_argument("--root-path", default=None, metavar="/PREFIX",
                     help="also serve the API under this path prefix (behind a proxy)")
    api.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                     help="bearer keys the API requires (or $VLLM_API_KEY / "
                          "$PDSERVE_AUTH_TOKENS; handed to the router in its environment)")
    compat = p.add_argument_group("accepted for vLLM compatibility, no effect")
    for flag, takes_value in VLLM_NO_OPS.items():
        compat.add_argument(flag, action="store" if takes_value else "store_true",
                            dest=f"noop_{flag[2:].replace('-', '_')}",
                            help="no effect (vLLM compatibility)")
    p.add_argument("--tls", choices=("off", "auto"), default="off",
                   help="auto: a throwaway CA and a certificate per process; the router's "
                        "APIs speak TLS and workers require the CA's client certificates")
    p.add_argument("--cluster-secret-file", default=None, metavar="FILE",
                   help="the cluster secret for internal calls (default: "
                        "$PDSERVE_CLUSTER_SECRET, else a fresh one); handed to every process "
                        "in its environment")


def _add_generate(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt")
    p.add_argument("--target", default="127.0.0.1:50051")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--timeout", type=float, default=120.0)
    from pdserve.serving.security.args import add_client_args

    add_client_args(p)


def _add_bench(p: argparse.ArgumentParser) -> None:
    from pdserve.loadgen.cli import add_arguments

    add_arguments(p)


def cmd_up(a: argparse.Namespace) -> int:
    from pdserve.default_model import DefaultModelError, ensure_default_model
    from pdserve.launcher import ClusterSpec, LocalCluster

    if a.model and a.model_arg and a.model != a.model_arg:
        print("error: give the model once (MODEL or --model)", file=sys.stderr)
        return 2
    try:
        model = a.model or a.model_arg or str(ensure_default_model())
    except DefaultModelError as exc:
        print(f"pdserve up: {exc}", file=sys.stderr)
        return 1
    secret = ""
    if a.cluster_secret_file:
        from pdserve.serving.security import SecretError, load_cluster_secret

        try:
            secret = load_cluster_secret({}, a.cluster_secret_file).value.decode()
        except SecretError as exc:
            print(f"pdserve up: {exc}", file=sys.stderr)
            return 2
    tp = a.tensor_parallel_size
    spec = ClusterSpec(model=model, host=a.host, port=a.port, num_prefill=a.prefill,
                       num_decode=a.decode, threads_per_worker=a.threads_per_worker,
                       prefill_tp=tp or a.prefill_tp, decode_tp=tp or a.decode_tp,
                       worker_args=(*engine_worker_args(a), *a.worker_arg,
                                    *_tier_worker_args(a), f"--drain-timeout={a.drain_timeout}"),
                       log_dir=a.log_dir, redis_url=a.redis, tls=a.tls == "auto",
                       env=_api_key_env(a),
                       cluster_secret=secret,
                       router_args=("--local-prefill-tokens", str(a.local_prefill_tokens),
                                    "--http-port", str(a.http_port),
                                    "--migration-limit", str(a.migration_limit),
                                    "--heartbeat-timeout", str(a.heartbeat_timeout),
                                    f"--shutdown-grace={a.shutdown_grace}",
                                    *api_router_args(a)))
    cluster = LocalCluster(spec)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    cluster.start(supervise=True)
    try:
        scheme = "s" if cluster.ca_path else ""
        print(f"pdserve router   grpc{scheme}://{cluster.address}  (model {model})", flush=True)
        if cluster.http_address:
            print(f"  openai api     http{scheme}://{cluster.http_address}/v1", flush=True)
        if cluster.ca_path:
            print(f"  tls            CA {cluster.ca_path} (pdserve generate --tls-ca "
                  f"{cluster.ca_path} ...); gone when the cluster stops", flush=True)
        for c in cluster.children:
            extra = f"  kv {c.info['kv_address']}" if "kv_address" in c.info else ""
            extra += f" ({c.info['kv_transport']})" if "kv_transport" in c.info else ""
            print(f"  {c.name:<10} grpc://{c.info['address']}{extra}", flush=True)
        if a.redis:
            print("  discovery      more workers join with: pdserve decode-worker|prefill-worker "
                  f"--model {model} (and $PDSERVE_REDIS_URL or --redis)", flush=True)
        print("Processes that exit are restarted. Ctrl-C stops everything.", flush=True)
        while not stop.wait(1.0):
            pass
    finally:
        # Longer than the router's and the workers' own graces: nothing is cut short.
        cluster.stop(grace_s=max(a.shutdown_grace, a.drain_timeout) + 5.0)
    return 0


def cmd_generate(a: argparse.Namespace) -> int:
    from pdserve.client import Client, PDServeError
    from pdserve.serving.security import args as security_args

    try:
        tls, token = security_args.client_tls(a), security_args.api_token(a)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with Client(a.target, token=token,
                root_certificates=tls.ca if tls is not None else None,
                private_key=tls.private_key if tls is not None else None,
                certificate_chain=tls.cert_chain if tls is not None else None) as client:
        try:
            last = None
            for chunk in client.stream(a.prompt, max_tokens=a.max_tokens,
                                       temperature=a.temperature, top_p=a.top_p, seed=a.seed,
                                       timeout=a.timeout):
                print(chunk.text, end="", flush=True)
                last = chunk
        except PDServeError as exc:
            print(f"\nerror: {exc}", file=sys.stderr)
            return 1
    if last is not None and last.usage is not None:
        u = last.usage
        print(f"\n[{last.finish_reason}; prompt {u.prompt_tokens} tokens, "
              f"completion {u.completion_tokens} tokens]", file=sys.stderr)
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    from pdserve.loadgen.cli import run

    return run(a)


def _add_ray(p: argparse.ArgumentParser) -> None:
    from pdserve.deploy.cli import add_arguments

    add_arguments(p)


def cmd_ray(a: argparse.Namespace) -> int:
    from pdserve.deploy.cli import run

    return run(a)


def cmd_demo_model(a: argparse.Namespace) -> int:
    from pdserve.demo_model import write_demo_model

    path = write_demo_model(a.dir, seed=a.seed)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())


def engine_worker_args(a: argparse.Namespace) -> tuple[str, ...]:
    """`pdserve up`'s vLLM engine flags that are set, as worker flags."""
    out: list[str] = []
    for name in ("dtype", "max_model_len", "block_size", "max_num_seqs",
                 "max_num_batched_tokens", "quantization", "kv_cache_dtype",
                 "speculative_config"):
        value = getattr(a, name)
        if value is not None:
            out += [f"--{name.replace('_', '-')}", str(value)]
    if a.enable_prefix_caching is not None:
        out.append("--enable-prefix-caching" if a.enable_prefix_caching
                   else "--no-enable-prefix-caching")
    if a.model_id:
        out += ["--served-model-name", *a.model_id]
    return tuple(out)


def api_router_args(a: argparse.Namespace) -> tuple[str, ...]:
    """`pdserve up`'s OpenAI API flags that are set, as router flags."""
    out: list[str] = []
    if a.model_id:
        out += ["--served-model-name", *a.model_id]
    if a.chat_template:
        out += ["--chat-template", a.chat_template]
    if a.tool_call_parser:
        out += ["--tool-call-parser", a.tool_call_parser]
    for flag in ("enable_auto_tool_choice", "enable_prompt_tokens_details",
                 "return_tokens_as_token_ids", "enable_force_include_usage"):
        if getattr(a, flag):
            out.append(f"--{flag.replace('_', '-')}")
    for name in ("max_logprobs", "root_path"):
        if getattr(a, name) is not None:
            out.append(f"--{name.replace('_', '-')}={getattr(a, name)}")
    return tuple(out)


def _api_key_env(a: argparse.Namespace) -> dict[str, str]:
    """--api-key reaches the router in its environment, never on its command line."""
    if not a.api_key:
        return {}
    keys = [k for k in os.environ.get("PDSERVE_AUTH_TOKENS", "").split(",") if k]
    return {"PDSERVE_AUTH_TOKENS": ",".join(dict.fromkeys([*keys, *a.api_key]))}


def _tier_worker_args(a: argparse.Namespace) -> tuple[str, ...]:
    """The KV tier and transport flags of `pdserve up`, as worker flags (only those set)."""
    out: list[str] = []
    if a.kv_host_gb:
        out.append(f"--kv-host-gb={a.kv_host_gb}")
    if a.kv_ssd_dir:
        out.append(f"--kv-ssd-dir={a.kv_ssd_dir}")
    if a.kv_ssd_gb:
        out.append(f"--kv-ssd-gb={a.kv_ssd_gb}")
    if a.kv_transport:
        out.append(f"--kv-transport={a.kv_transport}")
    if a.kv_nixl_reads is not None:
        out.append("--kv-nixl-reads" if a.kv_nixl_reads else "--no-kv-nixl-reads")
    return tuple(out)
