"""`pdserve ray ...`: a deployment on a Ray cluster, through the controller actor.

    pdserve ray up --model DIR --redis URL [--address auto] [--prefill N] [--decode M]
                   [--prefill-tp T] [--decode-tp T] [--gpus-per-rank G] [--host H] ...
                   (Ctrl-C stops it)
    pdserve ray scale --role decode --replicas K [--address auto]
    pdserve ray status [--address auto]

Imports nothing heavy until a command runs (Ray itself only then).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="ray_cmd", required=True)
    up = sub.add_parser("up", help="start a deployment; Ctrl-C stops it")
    _add_address(up)
    up.add_argument("--model", required=True, help="checkpoint dir, same path on every node")
    up.add_argument("--redis", default=os.environ.get("PDSERVE_REDIS_URL", ""), metavar="URL",
                    help="Redis registry and KV index (default: $PDSERVE_REDIS_URL)")
    up.add_argument("--prefill", type=int, default=1, help="prefill workers")
    up.add_argument("--decode", type=int, default=1, help="decode workers")
    up.add_argument("--prefill-tp", type=int, default=1)
    up.add_argument("--decode-tp", type=int, default=1)
    up.add_argument("--cpus-per-rank", type=float, default=1.0)
    up.add_argument("--gpus-per-rank", type=float, default=0.0, help="1 on GPU nodes")
    up.add_argument("--host", default="",
                    help="address every process binds (default: the IP of its Ray node)")
    up.add_argument("--port", type=int, default=50051, help="router gRPC port")
    up.add_argument("--http-port", type=int, default=8000, help="router HTTP port (-1 = none)")
    up.add_argument("--worker-arg", action="append", default=[],
                    help="extra flag for every worker (repeatable): --worker-arg=--dtype=bfloat16")
    scale = sub.add_parser("scale", help="resize one pool of the running deployment")
    _add_address(scale)
    scale.add_argument("--role", required=True, choices=("prefill", "decode"))
    scale.add_argument("--replicas", required=True, type=int)
    _add_address(sub.add_parser("status", help="the pools' workers and addresses (JSON)"))


def _add_address(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default="auto", help="Ray cluster address (default: auto)")


def run(a: argparse.Namespace) -> int:
    import ray

    from pdserve.deploy.controller import NAME, NAMESPACE

    ray.init(address=a.address, namespace=NAMESPACE, log_to_driver=False)
    if a.ray_cmd == "up":
        return _up(a, ray, NAME)
    controller = ray.get_actor(NAME)
    if a.ray_cmd == "scale":
        changed = ray.get(controller.scale.remote(a.role, a.replicas))
        print(f"{a.role} -> {a.replicas}: {' '.join(changed) or 'no change'}")
    print(json.dumps(ray.get(controller.status.remote()), indent=2))
    return 0


def _up(a: argparse.Namespace, ray, name: str) -> int:
    from pdserve.deploy.controller import Controller, spec_to_dict
    from pdserve.deploy.spec import PoolSpec, RayClusterSpec, RouterSpec

    def pool(role: str, n: int, tp: int) -> PoolSpec:
        return PoolSpec(role, replicas=n, tp=tp, cpus_per_rank=a.cpus_per_rank,
                        gpus_per_rank=a.gpus_per_rank, worker_args=tuple(a.worker_arg))

    try:
        spec = RayClusterSpec(model=a.model, redis_url=a.redis,
                              prefill=pool("prefill", a.prefill, a.prefill_tp),
                              decode=pool("decode", a.decode, a.decode_tp),
                              router=RouterSpec(port=a.port, http_port=a.http_port),
                              host=a.host)
    except ValueError as exc:
        print(f"pdserve ray up: {exc}", file=sys.stderr)
        return 2
    controller = ray.remote(Controller).options(name=name, num_cpus=0).remote(spec_to_dict(spec))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        print(json.dumps(ray.get(controller.start.remote()), indent=2), flush=True)
        print("Ctrl-C stops the deployment; `pdserve ray scale` resizes a pool.", flush=True)
        while not stop.wait(10.0):
            replaced = ray.get(controller.check.remote())
            if replaced:
                print(f"replaced: {' '.join(replaced)}", file=sys.stderr, flush=True)
    finally:
        ray.get(controller.stop.remote())
        ray.kill(controller)
    return 0
