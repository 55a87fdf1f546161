"""What a Ray deployment of pdserve is made of: the router and two pools, each sized and placed
on its own. Plain frozen data (str / int / float / dict), so it crosses into Ray actors without
anything but Ray's own plumbing."""

from __future__ import annotations

from dataclasses import dataclass, field

ROLES = ("prefill", "decode")


def _positive(owner: str, name: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{owner}.{name} must be {bound}, got {value}")


@dataclass(frozen=True)
class PoolSpec:
    """One worker pool (prefill or decode): how many workers, and what each one reserves."""

    role: str
    """prefill | decode."""
    replicas: int = 1
    """Workers at start-up (`RayCluster.scale` changes it later)."""
    tp: int = 1
    """Tensor-parallel ranks per worker: one placement-group bundle per rank, STRICT_PACK, so
    one worker's ranks always share a node."""
    cpus_per_rank: float = 1.0
    """Ray CPUs reserved per rank (fractions allowed: a test packs several workers on 2 CPUs)."""
    gpus_per_rank: float = 0.0
    """Ray GPUs reserved per rank (1 on GPU nodes; 0 = a CPU worker)."""
    resources: dict[str, float] = field(default_factory=dict, hash=False)
    """Custom Ray resources per worker, e.g. {"pdserve_prefill": 1}: start the prefill node type
    with that resource and the pool can only land there."""
    threads: int = 0
    """torch threads per worker process (0 = the CPUs reserved for rank 0, at least 1)."""
    worker_args: tuple[str, ...] = ()
    """Extra worker flags (engine options), e.g. ("--dtype", "bfloat16")."""
    module: str = ""
    """`python -m` entry of each worker ("" = prefill_worker / decode_worker): a site's
    wrapper, or a test double. It takes the worker flags and prints the READY line."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"PoolSpec.role must be one of {ROLES}, got {self.role!r}")
        owner = f"PoolSpec({self.role})"
        _positive(owner, "replicas", self.replicas, allow_zero=True)
        _positive(owner, "tp", self.tp)
        _positive(owner, "cpus_per_rank", self.cpus_per_rank)
        _positive(owner, "gpus_per_rank", self.gpus_per_rank, allow_zero=True)
        _positive(owner, "threads", self.threads, allow_zero=True)
        for name, amount in self.resources.items():
            if name in ("CPU", "GPU", "memory"):
                raise ValueError(f"{owner}.resources: use cpus_per_rank / gpus_per_rank, "
                                 f"not {name!r}")
            _positive(owner, f"resources[{name!r}]", amount)

    @property
    def entry_module(self) -> str:
        return self.module or f"{self.role}_worker"

    @property
    def worker_threads(self) -> int:
        return self.threads or max(1, int(self.cpus_per_rank))


@dataclass(frozen=True)
class RouterSpec:
    """The router: one process on the cluster, found by clients at `host:port`."""

    port: int = 50051
    """gRPC port (0 = any free port; the bound one is in `RayCluster.router_address`)."""
    http_port: int = 8000
    """OpenAI HTTP API (and /metrics) port: 0 = any free port, -1 = none."""
    num_cpus: float = 1.0
    resources: dict[str, float] = field(default_factory=dict, hash=False)
    """Custom Ray resources, e.g. {"pdserve_router": 1} to pin it to the ingress node."""
    args: tuple[str, ...] = ()
    """Extra router flags, e.g. ("--local-prefill-tokens", "64")."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"RouterSpec.port must be 0..65535, got {self.port}")
        if not -1 <= self.http_port <= 65535:
            raise ValueError(f"RouterSpec.http_port must be -1 (none), 0 (any) or a port, "
                             f"got {self.http_port}")
        _positive("RouterSpec", "num_cpus", self.num_cpus)


@dataclass(frozen=True)
class RayClusterSpec:
    """A whole deployment: the model, the Redis index every part meets in, two pools, a router."""

    model: str
    """Checkpoint directory, at the same path on every node."""
    redis_url: str = field(repr=False)
    """Redis KV index and worker registry (`redis://[user]:password@host:port/db`). Required:
    it is how the router discovers workers as pools grow and shrink. Handed to every process as
    $PDSERVE_REDIS_URL, never on a command line; never in a repr."""
    prefill: PoolSpec = field(default_factory=lambda: PoolSpec("prefill"))
    decode: PoolSpec = field(default_factory=lambda: PoolSpec("decode"))
    router: RouterSpec | None = field(default_factory=RouterSpec)
    """None = no router (pools only: an existing router follows the same Redis)."""
    host: str = ""
    """Address every process binds to and registers under; "" = the IP of the Ray node it
    lands on (what other nodes can reach). Tests on one machine pass 127.0.0.1."""
    env: dict[str, str] = field(default_factory=dict, hash=False)
    """Extra environment of every process (e.g. OMP_NUM_THREADS, log settings)."""
    cluster_secret: str = field(default="", repr=False)
    """Authenticates internal calls (`pdserve.serving.security`); "" = a fresh one when the
    cluster starts. Handed to every process as $PDSERVE_CLUSTER_SECRET (through the actor's
    call arguments, never a command line or a Ray runtime env); never in a repr."""
    ready_timeout_s: float = 300.0
    """How long a process may take to announce itself (model load included)."""
    stop_grace_s: float = 40.0
    """SIGTERM → SIGKILL grace when a process is stopped: longer than a worker's drain (it
    leaves the registry, gives routers notice, then finishes what it holds: 2 s + up to 30 s,
    `worker_base.DrainConfig`), so a scale-down cuts no request short."""

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("RayClusterSpec.model is required")
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("RayClusterSpec.redis_url must be a redis:// (or rediss://, "
                             "unix://) URL: the router discovers workers through Redis")
        if self.prefill.role != "prefill" or self.decode.role != "decode":
            raise ValueError("RayClusterSpec.prefill / .decode must have role prefill / decode")
        _positive("RayClusterSpec", "ready_timeout_s", self.ready_timeout_s)
        _positive("RayClusterSpec", "stop_grace_s", self.stop_grace_s)

    def pool(self, role: str) -> PoolSpec:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        return self.prefill if role == "prefill" else self.decode
