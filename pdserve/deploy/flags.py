"""`pdserve ray up`'s flags: one per setting of the deployment schema (`deploy.spec`), each
naming the field it sets, so a flag and a YAML key are the same thing. A flag given on the
command line overrides the deployment file (`-f`); one not given leaves the file's value (or
the schema's default). A test checks that every field has its flag.

    --decode 4            decode.replicas
    --decode-tp 2         decode.tp
    --gpus-per-rank 1     prefill.gpus_per_rank and decode.gpus_per_rank (both pools)
    --decode-high 0.85    autoscale.decode.high
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.deploy.spec import ROLES


@dataclass(frozen=True)
class Flag:
    flag: str
    paths: tuple[str, ...]
    """Dotted schema fields the flag sets (two for the flags shared by both pools)."""
    parse: Callable[[str], Any]
    help: str
    metavar: str = ""
    repeat: bool = False
    """Repeatable; the values form a list (worker args) or a mapping (KEY=VALUE)."""


def _mapping_json(text: str) -> dict[str, float]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError('expected a JSON object, e.g. {"decode_node": 1}')
    return value


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _secret_file(path: str) -> str:
    try:
        with open(path) as f:
            value = f.read().strip()
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {exc.strerror}") from None
    if not value:
        raise argparse.ArgumentTypeError(f"{path} is empty")
    return value


def _pool_flags(role: str) -> list[Flag]:
    p = f"{role}."
    return [
        Flag(f"--{role}", (p + "replicas",), int, f"{role} workers", "N"),
        Flag(f"--{role}-tp", (p + "tp",), int, f"tensor-parallel ranks per {role} worker", "T"),
        Flag(f"--{role}-cpus-per-rank", (p + "cpus_per_rank",), float,
             "Ray CPUs per rank", "C"),
        Flag(f"--{role}-gpus-per-rank", (p + "gpus_per_rank",), float,
             "Ray GPUs per rank (1 on GPU nodes)", "G"),
        Flag(f"--{role}-resources", (p + "resources",), _mapping_json,
             f"custom Ray resources per worker, JSON: '{{\"{role}_node\": 1}}'", "JSON"),
        Flag(f"--{role}-threads", (p + "threads",), int,
             "torch threads per worker (0 = CPUs per rank)", "N"),
        Flag(f"--{role}-worker-arg", (p + "worker_args",), str,
             f"extra flag for every {role} worker (repeatable)", "ARG", repeat=True),
        Flag(f"--{role}-module", (p + "module",), str,
             f"python -m entry of {role} workers (a site's wrapper)", "MODULE"),
    ]


def _autoscale_flags(role: str) -> list[Flag]:
    p = f"autoscale.{role}."
    what = "queued prefill tokens per worker" if role == "prefill" else "KV usage 0..1"
    return [
        Flag(f"--{role}-min", (p + "min_replicas",), int, f"fewest {role} workers", "N"),
        Flag(f"--{role}-max", (p + "max_replicas",), int, f"most {role} workers", "N"),
        Flag(f"--{role}-high", (p + "high",), float, f"scale up above this ({what})", "X"),
        Flag(f"--{role}-low", (p + "low",), float, f"scale down below this ({what})", "X"),
        Flag(f"--{role}-up-after", (p + "up_after",), int,
             "decisions in a row above high before scaling up", "N"),
        Flag(f"--{role}-down-after", (p + "down_after",), int,
             "decisions in a row below low before scaling down", "N"),
        Flag(f"--{role}-max-step-up", (p + "max_step_up",), int,
             "most workers added in one decision", "N"),
    ]


DEPLOYMENT = [
    Flag("--model", ("model",), str,
         "HF checkpoint dir or .gguf file, same path on every node", "PATH"),
    Flag("--redis", ("redis_url",), str,
         "Redis registry and KV index (default: $PDSERVE_REDIS_URL; keep the password out "
         "of command lines and files: prefer the variable)", "URL"),
    Flag("--cluster-secret-file", ("cluster_secret",), _secret_file,
         "file holding the cluster secret that authenticates internal calls (default: "
         "$PDSERVE_CLUSTER_SECRET, else a fresh one per deployment)", "FILE"),
    Flag("--host", ("host",), str,
         "address every process binds (default: the IP of its Ray node)", "H"),
    Flag("--env", ("env",), _key_value, "extra environment of every process (repeatable)",
         "KEY=VALUE", repeat=True),
    Flag("--log-dir", ("log_dir",), str,
         "process logs on each node (default: <ray session>/logs/pdserve)", "DIR"),
    Flag("--placement-timeout", ("placement_timeout_s",), float,
         "seconds a worker may wait for a node that can hold it", "S"),
    Flag("--ready-timeout", ("ready_timeout_s",), float,
         "seconds a process may take to be ready (model load included)", "S"),
    Flag("--drain-timeout", ("drain_timeout_s",), float,
         "workers' --drain-timeout: seconds a stopping worker lets its requests finish "
         "(default: the workers' own, 30)", "S"),
    Flag("--shutdown-grace", ("shutdown_grace_s",), float,
         "routers' --shutdown-grace: seconds a stopping router lets streams finish "
         "(default: the router's own, 30)", "S"),
    Flag("--stop-grace", ("stop_grace_s",), float,
         "SIGTERM -> SIGKILL grace; must outlast the drain and the shutdown grace", "S"),
    Flag("--reconcile-period", ("reconcile_period_s",), float,
         "seconds between the controller's checks of the declared sizes", "S"),
    Flag("--restart-backoff", ("restart_backoff_s",), float,
         "first wait before retrying a failed start (doubles, up to 60 s)", "S"),
]
SHARED_POOL = [
    Flag("--cpus-per-rank", tuple(f"{r}.cpus_per_rank" for r in ROLES), float,
         "Ray CPUs per rank, both pools", "C"),
    Flag("--gpus-per-rank", tuple(f"{r}.gpus_per_rank" for r in ROLES), float,
         "Ray GPUs per rank, both pools (1 on GPU nodes)", "G"),
    Flag("--worker-arg", tuple(f"{r}.worker_args" for r in ROLES), str,
         "extra flag for every worker (repeatable): --worker-arg=--dtype=bfloat16", "ARG",
         repeat=True),
]
ROUTER = [
    Flag("--routers", ("router.replicas",), int, "router processes (spread over nodes)", "N"),
    Flag("--port", ("router.port",), int, "router gRPC port (0 = any free port)", "P"),
    Flag("--http-port", ("router.http_port",), int,
         "router OpenAI HTTP and /metrics port (0 = any, -1 = none)", "P"),
    Flag("--router-cpus", ("router.num_cpus",), float, "Ray CPUs per router", "C"),
    Flag("--router-resources", ("router.resources",), _mapping_json,
         "custom Ray resources per router, JSON", "JSON"),
    Flag("--router-arg", ("router.args",), str, "extra router flag (repeatable)", "ARG",
         repeat=True),
]
AUTOSCALE = [Flag("--autoscale-period", ("autoscale.period_s",), float,
                  "seconds between autoscaling decisions", "S"),
             *(f for role in ROLES for f in _autoscale_flags(role))]
POOLS = [f for role in ROLES for f in _pool_flags(role)]
ALL = [*DEPLOYMENT, *POOLS, *SHARED_POOL, *ROUTER, *AUTOSCALE]


def dest(flag: Flag) -> str:
    return "set_" + flag.flag.lstrip("-").replace("-", "_")


def add_flags(p: argparse.ArgumentParser) -> None:
    groups = [("deployment", DEPLOYMENT), ("pools (per pool, or both)", POOLS + SHARED_POOL),
              ("routers", ROUTER),
              ("autoscaling (with --autoscale, or an autoscale: section in the file)",
               AUTOSCALE)]
    for title, flags in groups:
        g = p.add_argument_group(title)
        for f in flags:
            kind = {"action": "append"} if f.repeat else {}
            g.add_argument(f.flag, dest=dest(f), type=f.parse, default=None,
                           metavar=f.metavar or None, help=f.help, **kind)
    g = p.add_argument_group("switches")
    g.add_argument("--autoscale", action="store_true",
                   help="resize each pool on its own load (prefill: queued prefill tokens; "
                        "decode: KV usage), run by the controller")
    g.add_argument("--no-router", action="store_true",
                   help="pools only (an existing router follows the same Redis)")


def overrides(a: argparse.Namespace, file_has_autoscale: bool = False) -> dict[str, Any]:
    """Dotted field -> value for every flag given. ValueError, naming the flag, for autoscale
    settings without autoscaling."""
    out: dict[str, Any] = {}
    for f in ALL:
        value = getattr(a, dest(f))
        if value is None:
            continue
        if f.paths[0].startswith("autoscale.") and not (a.autoscale or file_has_autoscale):
            raise ValueError(f"{f.flag}: an autoscaling setting, but autoscaling is off "
                             "(add --autoscale)")
        if f.repeat and f.parse is _key_value:
            value = dict(value)
        for path in f.paths:
            if f in SHARED_POOL and path in out:
                continue  # the per-pool flag wins over the shared one
            out.setdefault(path, value)
    if a.autoscale and not file_has_autoscale and \
            not any(k.startswith("autoscale.") for k in out):
        out["autoscale"] = {}  # on, with the default rules
    if a.no_router:
        if any(k.startswith("router.") for k in out):
            raise ValueError("--no-router with router flags")
        out["router"] = None
    return out


def explain(message: str) -> str:
    """`message` (a schema error) with the flag of each field it names, e.g.
    "decode.tp must be > 0" -> "decode.tp (--decode-tp) must be > 0"."""
    import re

    out = message
    for f in ALL:
        for path in f.paths:
            section, _, name = path.rpartition(".")
            named = path in message or (section and re.search(
                rf"(^|\W){re.escape(section)}\W.*\b{re.escape(name)}\b", message))
            if named and f.flag not in out:
                out += f" [{path}: {f.flag}]"
    return out
