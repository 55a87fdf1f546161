"""`pdserve ray ...`: a deployment on a Ray cluster, through the controller actor.

    pdserve ray up --model DIR --redis URL [--address auto] [--prefill N] [--decode M]
                   [--prefill-tp T] [--decode-tp T] [--gpus-per-rank G] [--host H] ...
                   [--autoscale [--autoscale-period S] [--prefill-min N] [--prefill-max N]
                                [--decode-min N] [--decode-max N]]
                   (Ctrl-C stops it)
    pdserve ray scale --role decode --replicas K [--address auto]
    pdserve ray status [--address auto]

Imports nothing heavy until a command runs (Ray itself only then).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import threading

from pdserve.deploy.autoscale import AutoscaleConfig, AutoscalePolicy
from pdserve.deploy.autoscale_loop import DEFAULT_PERIOD_S, autoscale_loop
from pdserve.deploy.spec import ROLES, PoolSpec, RayClusterSpec, RouterSpec


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="ray_cmd", required=True)
    up = sub.add_parser("up", help="start a deployment; Ctrl-C stops it")
    _add_address(up)
    up.add_argument("--model", required=True,
                    help="HF checkpoint dir or .gguf file, same path on every node")
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
    _add_autoscale(up)
    scale = sub.add_parser("scale", help="resize one pool of the running deployment")
    _add_address(scale)
    scale.add_argument("--role", required=True, choices=("prefill", "decode"))
    scale.add_argument("--replicas", required=True, type=int)
    _add_address(sub.add_parser("status", help="the pools' workers and addresses (JSON)"))


def _add_address(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default="auto", help="Ray cluster address (default: auto)")


def _add_autoscale(up: argparse.ArgumentParser) -> None:
    g = up.add_argument_group("autoscaling (docs/runbooks/scaling-prefill.md, scaling-decode.md)")
    g.add_argument("--autoscale", action="store_true",
                   help="resize each pool on its own load: prefill on queued prefill tokens, "
                        "decode on KV-cache usage")
    g.add_argument("--autoscale-period", type=float, default=DEFAULT_PERIOD_S, metavar="S",
                   help=f"seconds between decisions (default {DEFAULT_PERIOD_S:g})")
    default = AutoscaleConfig()
    for role in ROLES:
        rule = default.rule(role)
        g.add_argument(f"--{role}-min", type=int, default=None, metavar="N",
                       help=f"fewest {role} workers (default {rule.min_replicas})")
        g.add_argument(f"--{role}-max", type=int, default=None, metavar="N",
                       help=f"most {role} workers (default {rule.max_replicas})")


def autoscale_config(a: argparse.Namespace) -> AutoscaleConfig | None:
    """The autoscaling policy's config from `ray up`'s flags (None without --autoscale): the
    bounds from the flags, the thresholds `AutoscaleConfig`'s defaults. ValueError, naming the
    flag, for bounds that cannot work."""
    bounds = {f"--{role}-{end}": getattr(a, f"{role}_{end}") for role in ROLES
              for end in ("min", "max")}
    if not a.autoscale:
        given = [flag for flag, value in bounds.items() if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: bounds for --autoscale, which is not set")
        return None
    if not a.autoscale_period > 0:
        raise ValueError(f"--autoscale-period must be > 0, got {a.autoscale_period}")
    default, rules = AutoscaleConfig(), {}
    for role in ROLES:
        rule, start = default.rule(role), getattr(a, role)
        lo = rule.min_replicas if bounds[f"--{role}-min"] is None else bounds[f"--{role}-min"]
        hi = rule.max_replicas if bounds[f"--{role}-max"] is None else bounds[f"--{role}-max"]
        if lo < 1:  # an empty pool reports no load, so nothing would ever grow it again
            raise ValueError(f"--{role}-min must be >= 1 with --autoscale, got {lo}")
        if lo > hi:
            raise ValueError(f"--{role}-min ({lo}) must be <= --{role}-max ({hi})")
        if not lo <= start <= hi:
            raise ValueError(f"--{role} ({start}) must be within --{role}-min ({lo}) and "
                             f"--{role}-max ({hi})")
        rules[role] = dataclasses.replace(rule, min_replicas=lo, max_replicas=hi)
    return AutoscaleConfig(**rules)


def run(a: argparse.Namespace) -> int:
    if a.ray_cmd == "up":
        try:  # flags first: a mistake must not wait for Ray
            spec, autoscale = up_spec(a), autoscale_config(a)
        except ValueError as exc:
            print(f"pdserve ray up: {exc}", file=sys.stderr)
            return 2
    import ray

    from pdserve.deploy.controller import NAME, NAMESPACE

    ray.init(address=a.address, namespace=NAMESPACE, log_to_driver=False)
    if a.ray_cmd == "up":
        return _up(ray, NAME, spec, autoscale, a.autoscale_period)
    controller = ray.get_actor(NAME)
    if a.ray_cmd == "scale":
        changed = ray.get(controller.scale.remote(a.role, a.replicas))
        print(f"{a.role} -> {a.replicas}: {' '.join(changed) or 'no change'}")
    print(json.dumps(ray.get(controller.status.remote()), indent=2))
    return 0


def up_spec(a: argparse.Namespace) -> RayClusterSpec:
    """The deployment `ray up`'s flags describe (ValueError from the spec's own checks)."""
    def pool(role: str, n: int, tp: int) -> PoolSpec:
        return PoolSpec(role, replicas=n, tp=tp, cpus_per_rank=a.cpus_per_rank,
                        gpus_per_rank=a.gpus_per_rank, worker_args=tuple(a.worker_arg))

    return RayClusterSpec(model=a.model, redis_url=a.redis,
                          prefill=pool("prefill", a.prefill, a.prefill_tp),
                          decode=pool("decode", a.decode, a.decode_tp),
                          router=RouterSpec(port=a.port, http_port=a.http_port), host=a.host)


def _up(ray, name: str, spec: RayClusterSpec, autoscale: AutoscaleConfig | None,
        period_s: float) -> int:
    from pdserve.deploy.controller import Controller, spec_to_dict
    from pdserve.observability.logs import configure_logging

    configure_logging("ray-up", "", os.environ)  # the autoscaler's decisions, on stderr
    controller = ray.remote(Controller).options(name=name, num_cpus=0).remote(spec_to_dict(spec))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    scaler = None
    try:
        print(json.dumps(ray.get(controller.start.remote()), indent=2), flush=True)
        print("Ctrl-C stops the deployment; `pdserve ray scale` resizes a pool.", flush=True)
        if autoscale is not None:
            scaler = _start_autoscaler(ray, controller, autoscale, period_s, stop)
        while not stop.wait(10.0):
            replaced = ray.get(controller.check.remote())
            if replaced:
                print(f"replaced: {' '.join(replaced)}", file=sys.stderr, flush=True)
    finally:
        stop.set()
        if scaler is not None:
            scaler.join()  # a round in progress ends first (the actor would make stop wait)
        ray.get(controller.stop.remote())
        ray.kill(controller)
    return 0


def _start_autoscaler(ray, controller, config: AutoscaleConfig, period_s: float,
                      stop: threading.Event) -> threading.Thread:
    """`autoscale_loop` on a thread of this driver, against the controller actor, until `stop`
    is set; it logs every decision with its reasons."""
    from pdserve.deploy.controller import RemoteCluster

    bounds = ", ".join(f"{role} [{config.rule(role).min_replicas}, "
                       f"{config.rule(role).max_replicas}]" for role in ROLES)
    print(f"autoscaling every {period_s:g}s within {bounds}", flush=True)
    thread = threading.Thread(target=autoscale_loop, name="pdserve-autoscaler", daemon=True,
                              args=(RemoteCluster(controller, ray.get), AutoscalePolicy(config),
                                    stop.wait, period_s))
    thread.start()
    return thread
