"""`pdserve ray ...`: a deployment on a Ray cluster, through its controller actor.

    pdserve ray up [-f deploy.yaml] [--model DIR] [--redis URL] [--detach] [flags...]
    pdserve ray status [--json]
    pdserve ray scale --role router|prefill|decode --replicas N [--no-wait]
    pdserve ray logs NAME [--lines N]
    pdserve ray down

Every command takes --address (default $RAY_ADDRESS, else auto) and --name (the deployment,
default pdserve). `up` without --detach keeps the deployment as long as the command runs
(Ctrl-C stops it); with --detach it returns once everything is ready and the deployment lives
on in the cluster until `pdserve ray down`. Every setting of the deployment schema is a flag
(`deploy.flags`) and a key of the YAML file. On a cluster with token authentication (Ray 2.60's
default when a token exists) set RAY_AUTH_MODE=token and give the token ($RAY_AUTH_TOKEN,
$RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token).

Imports nothing heavy until a command runs (Ray itself only then).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from typing import TextIO

from pdserve.deploy import flags

ROLES_SCALABLE = ("router", "prefill", "decode")


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="ray_cmd", required=True)
    up = sub.add_parser("up", help="start a deployment (--detach: it outlives this command)",
                        description="Start a deployment. Flags override the file's values.")
    _common(up)
    up.add_argument("-f", "--file", default=None, metavar="DEPLOY.YAML",
                    help="deployment file (the schema of pdserve.deploy.spec.RayClusterSpec)")
    up.add_argument("--detach", action="store_true",
                    help="return once ready; the deployment lives on until `pdserve ray down`")
    up.add_argument("--timeout", type=float, default=None, metavar="S",
                    help="longest wait for every process to be ready (default: placement + "
                         "ready timeouts)")
    flags.add_flags(up)
    status = sub.add_parser("status", help="every process, its phase and addresses")
    _common(status)
    status.add_argument("--json", action="store_true", help="the full status as JSON")
    scale = sub.add_parser("scale", help="resize one role of the running deployment")
    _common(scale)
    scale.add_argument("--role", required=True, choices=ROLES_SCALABLE)
    scale.add_argument("--replicas", required=True, type=int)
    scale.add_argument("--no-wait", action="store_true",
                       help="return at once (`pdserve ray status` shows the progress)")
    scale.add_argument("--timeout", type=float, default=600.0, metavar="S")
    logs = sub.add_parser("logs", help="the last lines of one process's stderr, and where "
                                       "its full log is")
    _common(logs)
    logs.add_argument("process", metavar="NAME", help="e.g. decode-0 (see `status`)")
    logs.add_argument("--lines", type=int, default=40)
    down = sub.add_parser("down", help="stop every process and the controller")
    _common(down)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=None,
                   help="Ray cluster address (default: $RAY_ADDRESS, else auto)")
    p.add_argument("--name", default=None,
                   help="deployment name (default: the file's, else pdserve)")


def run(a: argparse.Namespace) -> int:
    from pdserve.deploy.api import DeployError

    prog = f"pdserve ray {a.ray_cmd}"
    if a.ray_cmd == "up":
        try:  # flags first: a mistake must not wait for Ray
            spec = up_spec(a)
        except ValueError as exc:
            print(f"{prog}: {flags.explain(str(exc))}", file=sys.stderr)
            return 2
    try:
        if a.ray_cmd == "up":
            return _up(a, spec)
        return {"status": _status, "scale": _scale, "logs": _logs, "down": _down}[a.ray_cmd](a)
    except DeployError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1


def up_spec(a: argparse.Namespace):
    """The deployment `ray up` describes: the file, then the flags over it (ValueError, with
    the file and field named, from the schema's checks)."""
    import yaml

    from pdserve.deploy.spec import load_spec

    file_has_autoscale = False
    if a.file is not None:
        try:
            data = yaml.safe_load(open(a.file).read()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ValueError(f"{a.file}: {exc}") from None
        file_has_autoscale = isinstance(data, dict) and data.get("autoscale") is not None
    over = flags.overrides(a, file_has_autoscale)
    if a.name is not None:
        over["name"] = a.name
    return load_spec(a.file, over)


def _deployment(a: argparse.Namespace):
    from pdserve.deploy.api import Deployment

    return Deployment.connect(a.name or "pdserve", address=a.address)


def _up(a: argparse.Namespace, spec) -> int:
    from pdserve.deploy.api import Deployment

    print(f"starting deployment {spec.name!r}: {_sizes(spec.replicas())} ...", flush=True)
    d = Deployment.up(spec, address=a.address, detach=a.detach, timeout_s=a.timeout)
    st = d.status()
    print(format_status(st), flush=True)
    if a.detach:
        print(f"detached: `pdserve ray status --name {spec.name}` shows it, "
              f"`pdserve ray down --name {spec.name}` stops it.", flush=True)
        return 0
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print("Ctrl-C stops the deployment (or start it with --detach).", flush=True)
    seen = max((e.at for e in st.events), default=0.0)
    try:
        while not stop.wait(2.0):
            for e in d.status().events:  # what the controller did meanwhile
                if e.at > seen:
                    print(f"{_clock(e.at)} {e.what}", file=sys.stderr, flush=True)
                    seen = e.at
    finally:
        print(f"stopping deployment {spec.name!r} ...", flush=True)
        d.down()
    return 0


def _status(a: argparse.Namespace) -> int:
    from pdserve.deploy import schema

    out = _json_stdout() if a.json else sys.stdout
    t = time.monotonic()
    st = _deployment(a).status()
    took = time.monotonic() - t
    if a.json:
        print(json.dumps(schema.dump(st), indent=2), file=out, flush=True)
    else:
        print(format_status(st))
        print(f"(answered in {took:.2f}s)")
    return 0


def _json_stdout() -> TextIO:
    """A stream onto the real stdout for a JSON document, with fd 1 pointed at stderr for the
    rest of the process: Ray's driver threads print notices (a node that died, ...) to stdout,
    which would break `pdserve ray status --json | jq`."""
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    return out


def _scale(a: argparse.Namespace) -> int:
    d = _deployment(a)
    change = d.scale(a.role, a.replicas, wait=not a.no_wait, timeout_s=a.timeout)
    print(f"{a.role}: {change['from']} -> {change['to']}"
          + (f" ({change['note']})" if change["note"] else ""))
    print(format_status(d.status()))
    return 0


def _logs(a: argparse.Namespace) -> int:
    out = _deployment(a).logs(a.process, a.lines)
    print(f"# {a.process} on {out['node']}: full log {out['log']}")
    for line in out["lines"]:
        print(line)
    return 0


def _down(a: argparse.Namespace) -> int:
    stopped = _deployment(a).down()
    print(f"stopped: {' '.join(stopped) or 'nothing was running'}; controller removed")
    return 0


def format_status(st) -> str:
    """A table of every process with its addresses, then the latest events."""
    ready = {role: sum(1 for p in st.of(role) if p.phase == "ready") for role in st.targets}
    head = ", ".join(f"{role} {ready[role]}/{n}" for role, n in st.targets.items())
    lines = [f"deployment {st.name}: {head} ready" + ("" if st.converged else " (converging)")]
    cols = ("NAME", "PHASE", "GRPC", "METRICS", "HTTP", "KV", "NODE", "PID", "AGE", "LOG")
    rows = [cols] + [(p.name, p.phase, p.grpc or "-", p.metrics or "-", p.http or "-",
                      p.kv or "-", p.node or "-", str(p.pid) if p.pid > 0 else "-",
                      f"{p.age_s:.0f}s", p.log or "-") for p in st.processes]
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
              for r in rows]
    for p in st.processes:
        if p.error:
            lines.append(f"  {p.name}: {p.error}")
    if st.backoff:
        lines.append("  failing starts: " + ", ".join(f"{r} x{n}" for r, n in
                                                       st.backoff.items()))
    if st.autoscale:
        lines.append(f"  autoscale: {st.autoscale}")
    if st.events:
        lines.append("recent events:")
        lines += [f"  {_clock(e.at)} {e.what.splitlines()[0]}" for e in st.events[-8:]]
    return "\n".join(lines)


def _sizes(targets: dict[str, int]) -> str:
    return ", ".join(f"{n} {role}" for role, n in targets.items())


def _clock(at: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(at))


if __name__ == "__main__":  # `python -m pdserve.deploy.cli` = `pdserve ray`
    parser = argparse.ArgumentParser(prog="pdserve ray")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
