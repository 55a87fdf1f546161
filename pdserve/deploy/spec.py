"""The declarative schema of a Ray deployment of pdserve: one tree of frozen dataclasses, read
the same way from a YAML deployment file (`pdserve ray up -f deploy.yaml`), from `ray up`'s
flags (`deploy.flags`) and from Python (`RayClusterSpec(...)`, `load_spec(path)`).

    RayClusterSpec            the deployment: model, Redis, graces, timeouts
      ├─ prefill: PoolSpec    one worker pool, sized and placed on its own
      ├─ decode:  PoolSpec
      ├─ router:  RouterSpec  (null: no router; an existing one follows the same Redis)
      └─ autoscale: AutoscaleConfig  (null: pool sizes change only by `pdserve ray scale`)

Plain frozen data (str / int / float / bool / tuple / dict), so it crosses into the controller
actor as a dict (`schema.dump`) and comes back equal (`schema.load`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.deploy import schema
from pdserve.deploy.autoscale import ROLES, AutoscaleConfig

__all__ = ["ROLES", "PoolSpec", "RayClusterSpec", "RouterSpec", "load_spec",
           "WORKER_DRAIN_NOTICE_S", "WORKER_DRAIN_TIMEOUT_S", "ROUTER_SHUTDOWN_GRACE_S"]

WORKER_DRAIN_NOTICE_S = 2.0
"""`pdserve.serving.drain.DrainConfig.notice_s`: a stopping worker leaves the registry, then
still takes requests this long (a test pins the two together)."""
WORKER_DRAIN_TIMEOUT_S = 30.0
"""A worker's default `--drain-timeout`: the longest it waits for what it holds to finish."""
ROUTER_SHUTDOWN_GRACE_S = 30.0
"""The router's default `--shutdown-grace`: how long it lets streams in flight finish."""
STOP_MARGIN_S = 5.0
"""What a SIGTERM → SIGKILL grace must leave over a drain: process exit, registry calls."""


def _check(owner: str, name: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{owner}.{name} must be {bound}, got {value}")


def _check_resources(owner: str, resources: dict[str, float]) -> None:
    for name, amount in resources.items():
        if name in ("CPU", "GPU", "memory", "object_store_memory"):
            raise ValueError(f"{owner}.resources: {name!r} is not a custom resource (use "
                             "cpus_per_rank / gpus_per_rank / num_cpus)")
        _check(owner, f"resources[{name!r}]", amount)


@dataclass(frozen=True)
class PoolSpec:
    """One worker pool (prefill or decode): how many workers, and what each one reserves."""

    role: str
    """prefill | decode."""
    replicas: int = 1
    """Workers at start-up; `pdserve ray scale` and the autoscaler change it later."""
    tp: int = 1
    """Tensor-parallel ranks per worker: one placement-group bundle per rank, STRICT_PACK, so
    one worker's ranks always share a node."""
    cpus_per_rank: float = 1.0
    """Ray CPUs reserved per rank (fractions allowed: a test packs several workers on 2 CPUs)."""
    gpus_per_rank: float = 0.0
    """Ray GPUs reserved per rank (1 on GPU nodes; 0 = a CPU worker)."""
    resources: dict[str, float] = field(default_factory=dict, hash=False)
    """Custom Ray resources per worker (bundle 0), e.g. {"decode_node": 1}: start that node
    type with `ray start --resources='{"decode_node": 8}'` and the pool only lands there."""
    threads: int = 0
    """torch threads per worker process (0 = the CPUs reserved per rank, at least 1)."""
    worker_args: tuple[str, ...] = ()
    """Extra worker flags (engine options), e.g. ["--dtype", "bfloat16"]."""
    module: str = ""
    """`python -m` entry of each worker ("" = prefill_worker / decode_worker): a site's
    wrapper, or a test double. It takes the worker flags and prints the READY line."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"PoolSpec.role must be one of {ROLES}, got {self.role!r}")
        owner = f"PoolSpec({self.role})"
        _check(owner, "replicas", self.replicas, allow_zero=True)
        _check(owner, "tp", self.tp)
        _check(owner, "cpus_per_rank", self.cpus_per_rank)
        _check(owner, "gpus_per_rank", self.gpus_per_rank, allow_zero=True)
        _check(owner, "threads", self.threads, allow_zero=True)
        _check_resources(owner, self.resources)

    @property
    def entry_module(self) -> str:
        return self.module or f"{self.role}_worker"

    @property
    def worker_threads(self) -> int:
        return self.threads or max(1, int(self.cpus_per_rank))


@dataclass(frozen=True)
class RouterSpec:
    """The routers: stateless, each one follows the Redis registry and serves every worker."""

    replicas: int = 1
    """Router processes; Ray spreads them over nodes. With a fixed `port`, two on one node
    collide (the second one's start fails with "address already in use"): give each router
    node a custom resource in `resources`, or use port 0 behind a load balancer."""
    port: int = 50051
    """gRPC port (0 = any free port; `pdserve ray status` shows the bound one)."""
    http_port: int = 8000
    """OpenAI HTTP API (and /metrics) port: 0 = any free port, -1 = none."""
    num_cpus: float = 1.0
    """Ray CPUs reserved per router."""
    resources: dict[str, float] = field(default_factory=dict, hash=False)
    """Custom Ray resources per router, e.g. {"router_node": 1} to pin it to ingress nodes."""
    args: tuple[str, ...] = ()
    """Extra router flags, e.g. ["--local-prefill-tokens", "64"]."""

    def __post_init__(self) -> None:
        _check("RouterSpec", "replicas", self.replicas, allow_zero=True)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"RouterSpec.port must be 0..65535, got {self.port}")
        if not -1 <= self.http_port <= 65535:
            raise ValueError(f"RouterSpec.http_port must be -1 (none), 0 (any) or a port, "
                             f"got {self.http_port}")
        _check("RouterSpec", "num_cpus", self.num_cpus)
        _check_resources("RouterSpec", self.resources)


@dataclass(frozen=True)
class RayClusterSpec:
    """A whole deployment: the model, the Redis index every part meets in, two pools, the
    routers, autoscaling, and how processes are placed, started, replaced and stopped."""

    model: str
    """HF checkpoint directory or .gguf file, at the same path on every node."""
    redis_url: str = field(default="", repr=False)
    """Redis KV index and worker registry (`redis://[user]:password@host:port/db`). Required:
    it is how routers discover workers as pools grow and shrink. `pdserve ray up` takes it
    from --redis or $PDSERVE_REDIS_URL (keep it out of deployment files). Handed to every
    process as $PDSERVE_REDIS_URL, never on a command line; never in a repr."""
    name: str = "pdserve"
    """Deployment name: the controller actor is `<name>-controller` in Ray namespace
    `pdserve`, so one Ray cluster can hold several deployments."""
    prefill: PoolSpec = field(default_factory=lambda: PoolSpec("prefill"))
    """The prefill pool."""
    decode: PoolSpec = field(default_factory=lambda: PoolSpec("decode"))
    """The decode pool."""
    router: RouterSpec | None = field(default_factory=RouterSpec)
    """The routers (null = none: an existing router follows the same Redis)."""
    autoscale: AutoscaleConfig | None = None
    """Autoscaling of both pools by the controller (null = off)."""
    host: str = ""
    """Address every process binds to and registers under; "" = the IP of the Ray node it
    lands on (what other nodes can reach). Tests on one machine pass 127.0.0.1."""
    env: dict[str, str] = field(default_factory=dict, hash=False)
    """Extra environment of every process (e.g. OMP_NUM_THREADS, PDSERVE_LOG_FORMAT, or the
    TLS files as PDSERVE_TLS_CERT / _KEY / _CA, paths on every node: `pdserve.serving.security`)."""
    cluster_secret: str = field(default="", repr=False)
    """Authenticates internal calls (`pdserve.serving.security`); "" = a fresh one when the
    deployment starts (the controller makes it), else $PDSERVE_CLUSTER_SECRET or the file of
    `--cluster-secret-file`. Handed to every process as $PDSERVE_CLUSTER_SECRET (through the
    actor's call arguments, never a command line or a Ray runtime env); never in a repr."""
    placement_timeout_s: float = 120.0
    """How long a worker's placement group may wait for a node that can hold it before the
    start counts as failed (and is retried, with backoff)."""
    ready_timeout_s: float = 300.0
    """How long a process may take to announce itself (model load included)."""
    drain_timeout_s: float | None = None
    """Workers' `--drain-timeout` on SIGTERM (null = the workers' default, 30 s): how long a
    stopping worker lets the requests it holds finish."""
    shutdown_grace_s: float | None = None
    """Routers' `--shutdown-grace` on SIGTERM (null = the router's default, 30 s): how long a
    stopping router lets streams in flight finish."""
    stop_grace_s: float = 40.0
    """SIGTERM → SIGKILL grace when a process is stopped (scale-down, replacement, down): must
    outlast the worker drain (notice 2 s + drain_timeout_s) and the router's shutdown grace,
    so a graceful stop cuts no request short."""
    reconcile_period_s: float = 2.0
    """How often the controller compares the running processes with the declared pool sizes
    and replaces what died (a process exit, a lost actor or node)."""
    restart_backoff_s: float = 5.0
    """Wait before retrying a pool whose last start failed; doubles on each failure in a row,
    up to 60 s, so a crash-looping worker does not hammer the cluster."""
    log_dir: str = ""
    """Where each process's stdout/stderr go on its node ("" = `pdserve/` under the Ray
    session's log directory, /tmp/ray/session_latest/logs/pdserve)."""

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("RayClusterSpec.model is required")
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("RayClusterSpec.redis_url must be a redis:// (or rediss://, "
                             "unix://) URL (--redis or $PDSERVE_REDIS_URL): the router "
                             "discovers workers through Redis")
        if not self.name or not all(c.isalnum() or c in "-_" for c in self.name):
            raise ValueError(f"RayClusterSpec.name must be letters, digits, - or _, got "
                             f"{self.name!r}")
        if self.prefill.role != "prefill" or self.decode.role != "decode":
            raise ValueError("RayClusterSpec.prefill / .decode must have role prefill / decode")
        for name in ("placement_timeout_s", "ready_timeout_s", "stop_grace_s",
                     "reconcile_period_s", "restart_backoff_s"):
            _check("RayClusterSpec", name, getattr(self, name))
        for name in ("drain_timeout_s", "shutdown_grace_s"):
            if getattr(self, name) is not None:
                _check("RayClusterSpec", name, getattr(self, name), allow_zero=True)
        self._check_graces()
        if self.autoscale is not None:
            for role in ROLES:
                rule, start = self.autoscale.rule(role), self.pool(role).replicas
                if not rule.min_replicas <= start <= rule.max_replicas:
                    raise ValueError(f"{role}.replicas ({start}) must be within "
                                     f"autoscale.{role}.min_replicas ({rule.min_replicas}) "
                                     f"and max_replicas ({rule.max_replicas})")

    def _check_graces(self) -> None:
        drain = WORKER_DRAIN_NOTICE_S + self.worker_drain_s
        need = max(drain, self.router_grace_s if self.router is not None else 0.0)
        if self.stop_grace_s < need + STOP_MARGIN_S:
            raise ValueError(f"RayClusterSpec.stop_grace_s ({self.stop_grace_s:g}) must be at "
                             f"least {need + STOP_MARGIN_S:g}: a worker's drain takes up to "
                             f"{drain:g}s (notice {WORKER_DRAIN_NOTICE_S:g} + drain_timeout_s "
                             f"{self.worker_drain_s:g}), the router's shutdown up to "
                             f"{self.router_grace_s:g}s, plus {STOP_MARGIN_S:g}s to exit")

    @property
    def worker_drain_s(self) -> float:
        return WORKER_DRAIN_TIMEOUT_S if self.drain_timeout_s is None else self.drain_timeout_s

    @property
    def router_grace_s(self) -> float:
        return ROUTER_SHUTDOWN_GRACE_S if self.shutdown_grace_s is None \
            else self.shutdown_grace_s

    @property
    def controller_name(self) -> str:
        return f"{self.name}-controller"

    def pool(self, role: str) -> PoolSpec:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        return self.prefill if role == "prefill" else self.decode

    def replicas(self) -> dict[str, int]:
        """The declared size of every role (router included)."""
        routers = 0 if self.router is None else self.router.replicas
        return {"router": routers, **{role: self.pool(role).replicas for role in ROLES}}


def load_spec(path: str | os.PathLike | None = None, overrides: dict[str, Any] | None = None,
              environ: dict[str, str] | None = None) -> RayClusterSpec:
    """The deployment a YAML file describes (`path`; None = flags only), with `overrides`
    (dotted field paths, e.g. {"decode.replicas": 4}) applied on top, and the Redis URL and
    the cluster secret taken from $PDSERVE_REDIS_URL / $PDSERVE_CLUSTER_SECRET when neither
    gives one. SchemaError names the file and field."""
    import yaml

    data: dict[str, Any] = {}
    where = ""
    if path is not None:
        where = str(path)
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise schema.SchemaError(f"{where}: {exc}") from None
        if not isinstance(data, dict):
            raise schema.SchemaError(f"{where}: expected a mapping of deployment fields")
    for dotted, value in (overrides or {}).items():
        _set(data, dotted.split("."), value)
    env = os.environ if environ is None else environ
    if not data.get("redis_url") and env.get("PDSERVE_REDIS_URL"):
        data["redis_url"] = env["PDSERVE_REDIS_URL"]
    if not data.get("cluster_secret") and env.get("PDSERVE_CLUSTER_SECRET"):
        data["cluster_secret"] = env["PDSERVE_CLUSTER_SECRET"]
    try:
        return schema.load(RayClusterSpec, data)
    except schema.SchemaError as exc:
        raise schema.SchemaError(f"{where}: {exc}" if where else str(exc)) from None


def _set(data: dict[str, Any], keys: list[str], value: Any) -> None:
    for key in keys[:-1]:
        child = data.get(key)
        if not isinstance(child, dict):
            child = data[key] = {}
        data = child
    data[keys[-1]] = value
