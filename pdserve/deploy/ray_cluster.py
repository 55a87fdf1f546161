"""`RayCluster`: places the router, the prefill pool and the decode pool on a Ray cluster, each
sized on its own, and changes a pool's size while it serves.

    cluster = RayCluster(RayClusterSpec(model=..., redis_url=...)).start()   # ray.init() first
    cluster.scale("decode", 4)          # +/- workers of one pool
    cluster.status()                    # {"prefill": [WorkerStatus...], "decode": [...]}
    cluster.autoscale_once(policy)      # one policy decision, applied
    cluster.check()                     # replace workers whose process or node died
    cluster.stop()

Every worker is one `ProcessActor` in its own placement group (`deploy.placement`). Nothing
tells the router about a worker: a worker registers itself in Redis under the address it
announced, and the router follows the registry; a stopped worker unregisters, so the router
drops it. This object is the only owner of the actors; it holds no Ray state at import time
and never calls `ray.init` (the caller chooses the cluster).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import secrets
from dataclasses import dataclass, field
from typing import Any

from pdserve.deploy import placement
from pdserve.deploy.actors import ProcessActor, RankHolder
from pdserve.deploy.autoscale import (
    AutoscalePolicy,
    AutoscaleState,
    Decision,
    WorkerLoad,
    least_loaded,
)
from pdserve.deploy.process import CLUSTER_SECRET_ENV, REDIS_URL_ENV
from pdserve.deploy.spec import ROLES, RayClusterSpec

log = logging.getLogger(__name__)


@dataclass
class _Worker:
    name: str
    role: str
    actor: Any
    group: Any
    """The worker's placement group (None for the router)."""
    holders: list[Any] = field(default_factory=list)
    info: dict = field(default_factory=dict)


@dataclass(frozen=True)
class WorkerStatus:
    name: str
    role: str
    address: str
    """host:port of its gRPC server, as registered in Redis."""
    pid: int
    state: str
    """starting | ready | exited | stopped | lost (actor or node gone)."""
    gpus: tuple[str, ...] = ()
    """GPU ids (on its node) of every rank of the worker."""


class RayCluster:
    def __init__(self, spec: RayClusterSpec) -> None:
        import ray  # noqa: F401 — fail here, with Ray's own message, when it is missing

        if not spec.cluster_secret:  # every process of this deployment shares one
            spec = dataclasses.replace(spec, cluster_secret=secrets.token_urlsafe(32))
        self.spec = spec
        self.pools: dict[str, list[_Worker]] = {role: [] for role in ROLES}
        self.router: _Worker | None = None
        self._ids = {role: itertools.count() for role in ROLES}
        self._autoscale_state = AutoscaleState()

    # -- life cycle --------------------------------------------------------------------------
    def start(self) -> RayCluster:
        """Both pools (in parallel), then the router; on any failure everything started is
        stopped again."""
        try:
            self._add(self.spec.prefill.replicas, self.spec.decode.replicas)
            if self.spec.router is not None:
                self.router = self._start_router()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Router first (clients see UNAVAILABLE, not a router without workers), then every
        worker, each SIGTERM then SIGKILL; actors and placement groups are released."""
        if self.router is not None:
            self._release([self.router])
            self.router = None
        self._release([w for role in ROLES for w in self.pools[role]])
        for role in ROLES:
            self.pools[role] = []

    def __enter__(self) -> RayCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def router_address(self) -> str:
        if self.router is None:
            raise RuntimeError("this cluster has no router")
        return self.router.info["address"]

    @property
    def http_address(self) -> str | None:
        return None if self.router is None else self.router.info.get("http_address")

    # -- pools -------------------------------------------------------------------------------
    def scale(self, role: str, replicas: int) -> list[str]:
        """Grow or shrink one pool to `replicas` workers; the names added or removed. Shrinking
        removes the least loaded workers first, each stopped gracefully: on SIGTERM it leaves
        the Redis registry (the router stops choosing it) and finishes the requests it holds,
        within `spec.stop_grace_s`. Blocks until they are gone."""
        self.spec.pool(role)  # validates the role
        if replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {replicas}")
        current = len(self.pools[role])
        if replicas > current:
            added = self._add(**{role: replicas - current})
            return [w.name for w in added]
        removed = []
        for _ in range(current - replicas):
            loads = self.loads(role)
            # A worker that cannot answer stats is the first to go: it serves nobody.
            silent = [w.name for w in self.pools[role] if w.name not in loads]
            victim = silent[0] if silent else least_loaded(role, loads)
            worker = next(w for w in self.pools[role] if w.name == victim)
            self.pools[role].remove(worker)
            self._release([worker])
            removed.append(victim)
        return removed

    def status(self) -> dict[str, list[WorkerStatus]]:
        """Every worker of each pool, with its address and what its actor says of it."""
        import ray

        out: dict[str, list[WorkerStatus]] = {}
        for role in ROLES:
            states = [w.actor.poll.remote() for w in self.pools[role]]
            out[role] = [WorkerStatus(w.name, role, w.info.get("address", ""),
                                      int(w.info.get("pid", -1)), _get_or(ray, ref, "lost"),
                                      tuple(w.info.get("gpus", ())))
                         for w, ref in zip(self.pools[role], states, strict=True)]
        return out

    def loads(self, role: str) -> dict[str, WorkerLoad]:
        """The load of each worker of `role` that answered its stats."""
        import ray

        refs = {w.name: w.actor.stats.remote() for w in self.pools[role]}
        out = {}
        for name, ref in refs.items():
            stats = _get_or(ray, ref, None, timeout_s=10.0)
            if stats is not None and "error" not in stats:
                out[name] = WorkerLoad.from_stats(stats)
        return out

    def check(self) -> list[str]:
        """Replace every worker whose process exited or whose actor (or node) is gone; the
        names of the workers replaced."""
        dead = [s for role, ws in self.status().items() for s in ws
                if s.state in ("exited", "lost")]
        for s in dead:
            worker = next(w for w in self.pools[s.role] if w.name == s.name)
            log.warning("%s (%s) is %s: replacing it", s.name, s.address, s.state)
            self.pools[s.role].remove(worker)
            self._release([worker])
        counts = {role: sum(1 for s in dead if s.role == role) for role in ROLES}
        if any(counts.values()):
            self._add(**counts)
        return [s.name for s in dead]

    def autoscale_once(self, policy: AutoscalePolicy) -> Decision:
        """Ask `policy` for both pools' sizes given their current load, and apply them. The
        policy's hysteresis state is kept here between calls."""
        sizes = {role: len(self.pools[role]) for role in ROLES}
        loads = {role: list(self.loads(role).values()) for role in ROLES}
        decision = policy.decide(sizes, loads, self._autoscale_state)
        self._autoscale_state = decision.state
        for role, (size, target) in decision.changes().items():
            log.info("autoscale %s: %d -> %d (%s)", role, size, target, decision.reasons[role])
            self.scale(role, target)
        return decision

    # -- placing processes -------------------------------------------------------------------
    def _add(self, prefill: int = 0, decode: int = 0) -> list[_Worker]:
        """Place and start workers; they load their model in parallel."""
        import ray

        placed: list[_Worker] = []
        try:
            for role, n in (("decode", decode), ("prefill", prefill)):
                placed += [self._place(role) for _ in range(n)]
            starts = [self._start_worker(w) for w in placed]
            for w, ref in zip(placed, starts, strict=True):
                w.info = ray.get(ref)
                self.pools[w.role].append(w)
        except BaseException:
            self._release([w for w in placed if w not in self.pools[w.role]])
            raise
        return placed

    def _place(self, role: str) -> _Worker:
        """A placement group for one worker of `role`, its supervising actor in bundle 0 and a
        holder in each other bundle that reserves GPUs."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        pool = self.spec.pool(role)
        name = f"{role}-{next(self._ids[role])}"
        bundles = placement.rank_bundles(pool)
        group = placement_group(bundles, strategy=placement.STRATEGY, name=f"pdserve-{name}")
        try:
            ray.get(group.ready(), timeout=self.spec.ready_timeout_s)
        except BaseException as exc:
            remove_placement_group(group)
            raise RuntimeError(f"{name}: no node could take its placement group {bundles} "
                               f"({placement.STRATEGY}) within {self.spec.ready_timeout_s:.0f}"
                               "s") from exc
        actor = _remote(ProcessActor, placement.bundle_request(bundles[0]), group, 0).remote(name)
        holders = [_remote(RankHolder, placement.bundle_request(b), group, i).remote()
                   for i, b in enumerate(bundles) if i > 0 and b.get("GPU")]
        return _Worker(name, role, actor, group, holders)

    def _start_worker(self, w: _Worker) -> Any:
        import ray

        pool = self.spec.pool(w.role)
        host = self.spec.host or ray.get(w.actor.host.remote())
        gpus = [g for ids in ray.get([h.gpu_ids.remote() for h in w.holders]) for g in ids]
        args = placement.worker_args(self.spec.model, pool, w.name, host)
        return w.actor.start.remote(pool.entry_module, args, self._env(), gpus,
                                    self.spec.ready_timeout_s)

    def _start_router(self) -> _Worker:
        import ray

        router = self.spec.router
        assert router is not None
        actor = _remote(ProcessActor, placement.router_request(router), None, 0).remote("router")
        w = _Worker("router", "router", actor, None)
        try:
            host = self.spec.host or ray.get(actor.host.remote())
            w.info = ray.get(actor.start.remote(
                "router", placement.router_args(self.spec.model, router, host), self._env(),
                [], self.spec.ready_timeout_s))
        except BaseException:
            self._release([w])
            raise
        return w

    def _env(self) -> dict[str, str]:
        return {**self.spec.env, REDIS_URL_ENV: self.spec.redis_url,
                CLUSTER_SECRET_ENV: self.spec.cluster_secret}

    def _release(self, workers: list[_Worker]) -> None:
        """Stop the processes (in parallel), then free their actors and placement groups."""
        import ray
        from ray.util.placement_group import remove_placement_group

        grace = self.spec.stop_grace_s
        stops = [w.actor.stop.remote(grace) for w in workers]
        for w, ref in zip(workers, stops, strict=True):
            _get_or(ray, ref, None, timeout_s=grace + 30)
            for a in [w.actor, *w.holders]:
                ray.kill(a)
            if w.group is not None:
                remove_placement_group(w.group)


def _remote(cls: type, req: placement.ActorRequest, group: Any, bundle: int) -> Any:
    """`cls` as a Ray actor asking for `req`, inside `bundle` of `group` when given."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    options: dict[str, Any] = {"num_cpus": req.num_cpus, "num_gpus": req.num_gpus,
                               "resources": req.resources, "max_restarts": 0}
    if group is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=bundle)
    return ray.remote(cls).options(**options)


def _get_or(ray: Any, ref: Any, default: Any, timeout_s: float = 10.0) -> Any:
    """`ray.get(ref)`, or `default` when the actor, its node or the call failed."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except (ray.exceptions.RayError, TimeoutError) as exc:
        log.debug("ray call failed: %s", exc)
        return default
