"""What `pdserve ray status` (and `Deployment.status()`) reports: every process of the
deployment with every address it serves on, as frozen data that crosses from the controller
actor as a dict (`schema.dump` / `schema.load`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ProcessStatus:
    name: str
    """e.g. decode-3 (unique within the deployment; also the worker id in Redis)."""
    role: str
    """router | prefill | decode."""
    phase: str
    """placing | starting | ready | draining | failed | lost (`reconcile.Phase`)."""
    grpc: str = ""
    """host:port of its gRPC server (workers: as registered in Redis; router: the public API)."""
    metrics: str = ""
    """host:port serving Prometheus /metrics (workers: --metrics-port; router: its HTTP port)."""
    http: str = ""
    """Router only: the OpenAI-compatible HTTP API."""
    kv: str = ""
    """Decode only: its KV transfer rendezvous."""
    node: str = ""
    """IP of the Ray node it runs on."""
    node_id: str = ""
    pid: int = -1
    gpus: tuple[str, ...] = ()
    """GPU ids (on its node) of every rank."""
    log: str = ""
    """Its stdout/stderr, on `node` (`pdserve ray logs NAME` reads the tail from anywhere)."""
    error: str = ""
    """Why it failed or was lost (for a failed start: the last lines of its stderr)."""
    age_s: float = 0.0
    """Seconds in the current phase."""


@dataclass(frozen=True)
class Event:
    at: float
    """Unix time."""
    what: str


@dataclass(frozen=True)
class DeploymentStatus:
    name: str
    targets: dict[str, int]
    """Declared size of each role (router, prefill, decode)."""
    processes: tuple[ProcessStatus, ...] = ()
    events: tuple[Event, ...] = field(default=())
    """The latest events, oldest first: starts, replacements, drains, failures, decisions."""
    autoscale: str = ""
    """The last autoscaling decision with its reasons ("" = autoscaling off or none yet)."""
    backoff: dict[str, int] = field(default_factory=dict)
    """Roles whose starts are failing: failures in a row."""

    def of(self, role: str) -> list[ProcessStatus]:
        return [p for p in self.processes if p.role == role]

    @property
    def converged(self) -> bool:
        """Every role has exactly its declared number of ready processes, and nothing else."""
        return all(sum(1 for p in self.of(role) if p.phase == "ready") == n
                   for role, n in self.targets.items()) and \
            all(p.phase == "ready" for p in self.processes)

    def routers(self) -> list[str]:
        return [p.grpc for p in self.of("router") if p.phase == "ready"]
