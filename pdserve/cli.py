"""The `pdserve` command: one entry point for every role.

    pdserve up [--model DIR] [--host H] [--port P] [--http-port P] [--prefill N] [--decode M]
    pdserve generate [--target HOST:PORT] "prompt"
    pdserve demo-model DIR
    pdserve router|prefill-worker|decode-worker ...   (one process of a role)
"""

from __future__ import annotations

import argparse
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
    demo = sub.add_parser("demo-model", help="write the random demo checkpoint")
    demo.add_argument("dir")
    demo.add_argument("--seed", type=int, default=0)
    a = parser.parse_args(argv)
    return {"up": cmd_up, "generate": cmd_generate, "demo-model": cmd_demo_model}[a.cmd](a)


def _add_up(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint dir (default: the demo model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--http-port", type=int, default=8000,
                   help="OpenAI-compatible HTTP API port (0 = any free port, -1 = none)")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers")
    p.add_argument("--decode", type=int, default=1, help="decode workers")
    p.add_argument("--threads-per-worker", type=int, default=0)
    p.add_argument("--local-prefill-tokens", type=int, default=32)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--worker-arg", action="append", default=[],
                   help="extra flag for every worker (repeatable): --worker-arg=--dtype=bfloat16")


def _add_generate(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt")
    p.add_argument("--target", default="127.0.0.1:50051")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--token", default=None, help="bearer token")


def cmd_up(a: argparse.Namespace) -> int:
    from pdserve.demo_model import ensure_demo_model
    from pdserve.launcher import ClusterSpec, LocalCluster

    model = a.model or str(ensure_demo_model())
    spec = ClusterSpec(model=model, host=a.host, port=a.port, num_prefill=a.prefill,
                       num_decode=a.decode, threads_per_worker=a.threads_per_worker,
                       worker_args=tuple(a.worker_arg), log_dir=a.log_dir,
                       router_args=("--local-prefill-tokens", str(a.local_prefill_tokens),
                                    "--http-port", str(a.http_port)))
    cluster = LocalCluster(spec)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    cluster.start()
    try:
        print(f"pdserve router   grpc://{cluster.address}  (model {model})", flush=True)
        if cluster.http_address:
            print(f"  openai api     http://{cluster.http_address}/v1", flush=True)
        for c in cluster.children:
            extra = f"  kv {c.info['kv_address']}" if "kv_address" in c.info else ""
            print(f"  {c.name:<10} grpc://{c.info['address']}{extra}", flush=True)
        print("Ctrl-C stops everything.", flush=True)
        while not stop.wait(1.0):
            dead = [c.name for c in [cluster.router, *cluster.children]
                    if c is not None and c.proc.poll() is not None]
            if dead:
                print(f"stopping: {', '.join(dead)} exited", file=sys.stderr)
                return 1
    finally:
        cluster.stop()
    return 0


def cmd_generate(a: argparse.Namespace) -> int:
    from pdserve.client import Client, PDServeError

    with Client(a.target, token=a.token) as client:
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


def cmd_demo_model(a: argparse.Namespace) -> int:
    from pdserve.demo_model import write_demo_model

    path = write_demo_model(a.dir, seed=a.seed)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
