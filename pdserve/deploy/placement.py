"""What each process of a deployment asks Ray for, and the command line it runs: pure
functions of the spec, so they are tested without Ray.

A worker gets its own placement group: one bundle per TP rank, `STRICT_PACK` (all of a worker's
ranks on one node: they exchange activations every layer). Bundle 0 also carries the pool's
custom resources (one unit per worker, not per rank), which is how an operator pins a pool to a
node type. The supervising actor runs in bundle 0 and asks for exactly that bundle.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.deploy.spec import PoolSpec, RouterSpec

STRATEGY = "STRICT_PACK"


@dataclass(frozen=True)
class ActorRequest:
    """The resources one actor asks for (inside its bundle, when it has a placement group)."""

    num_cpus: float
    num_gpus: float
    resources: dict[str, float]


def rank_bundles(pool: PoolSpec) -> list[dict[str, float]]:
    """The placement group of one worker of `pool`: a bundle per TP rank."""
    bundles = []
    for rank in range(pool.tp):
        b: dict[str, float] = {"CPU": pool.cpus_per_rank}
        if pool.gpus_per_rank:
            b["GPU"] = pool.gpus_per_rank
        if rank == 0:
            b.update(pool.resources)
        bundles.append(b)
    return bundles


def bundle_request(bundle: dict[str, float]) -> ActorRequest:
    """What an actor placed in `bundle` asks for: all of it."""
    return ActorRequest(num_cpus=bundle.get("CPU", 0.0), num_gpus=bundle.get("GPU", 0.0),
                        resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")})


def router_request(router: RouterSpec) -> ActorRequest:
    return ActorRequest(num_cpus=router.num_cpus, num_gpus=0.0, resources=dict(router.resources))


def worker_args(model: str, pool: PoolSpec, worker_id: str, host: str,
                drain_timeout_s: float | None = None) -> list[str]:
    """The flags of one worker process (the Redis URL goes in its environment instead). Its
    metrics port is any free one (`--metrics-port 0`), announced and shown by `status`."""
    drain = [] if drain_timeout_s is None else ["--drain-timeout", f"{drain_timeout_s:g}"]
    return ["--model", model, "--host", host, "--port", "0", "--worker-id", worker_id,
            "--metrics-port", "0", "--tp", str(pool.tp), "--threads", str(pool.worker_threads),
            *drain, *pool.worker_args]


def router_args(model: str, router: RouterSpec, host: str,
                shutdown_grace_s: float | None = None) -> list[str]:
    """The router's flags: no worker lists, it discovers both pools in Redis."""
    grace = [] if shutdown_grace_s is None else ["--shutdown-grace", f"{shutdown_grace_s:g}"]
    return ["--model", model, "--host", host, "--port", str(router.port),
            "--http-port", str(router.http_port), *grace, *router.args]
