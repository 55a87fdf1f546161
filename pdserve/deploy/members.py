"""The Ray side of one member of a deployment (a router or a worker process): its record, and
how it is placed, started, stopped and released. The controller owns the lifecycle (phases,
events, backoff: `deploy.controller`); this module only does the Ray calls, each awaited
without blocking the controller's event loop.

    place(m, spec)    a worker: its placement group (one bundle per TP rank, STRICT_PACK),
                      ready within spec.placement_timeout_s; a router: nothing
    start(m, spec)    its ProcessActor (and RankHolders) and the process, up to its READY line
    stop(m, grace)    SIGTERM, SIGKILL after `grace`; what happened, in words
    release(m)        its actors and placement group freed
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.deploy import placement, reconcile
from pdserve.deploy.actors import MAX_CONCURRENCY, ProcessActor, RankHolder
from pdserve.deploy.reconcile import Phase
from pdserve.deploy.spec import RayClusterSpec
from pdserve.deploy.status import ProcessStatus
from pdserve.serving.security.secret import CLUSTER_SECRET_ENV
from pdserve.serving.worker_options import REDIS_URL_ENV

CALL_TIMEOUT_S = 10.0
"""Longest wait for a quick actor call (poll, node, stats, tail)."""


@dataclass
class MemberState:
    """One process of the deployment, as the controller tracks it (owned by the loop)."""

    name: str
    role: str
    serial: int
    phase: Phase = Phase.PLACING
    since: float = field(default_factory=time.monotonic)
    actor: Any = None
    holders: list[Any] = field(default_factory=list)
    group: Any = None
    node: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)
    error: str = ""
    task: asyncio.Task | None = None

    def view(self) -> reconcile.Member:
        return reconcile.Member(self.name, self.role, self.phase, self.serial)

    def status(self, now: float) -> ProcessStatus:
        i = self.info
        metrics = i.get("metrics_address", "") or (i.get("http_address", "")
                                                   if self.role == "router" else "")
        return ProcessStatus(
            name=self.name, role=self.role, phase=self.phase.value, grpc=i.get("address", ""),
            metrics=metrics, http=i.get("http_address", "") if self.role == "router" else "",
            kv=i.get("kv_address", ""), node=self.node.get("ip", ""),
            node_id=self.node.get("node_id", ""), pid=int(i.get("pid", -1)),
            gpus=tuple(i.get("gpus", ())), log=i.get("log", ""), error=self.error,
            age_s=round(now - self.since, 1))


class StartFailure(RuntimeError):
    """A member could not be placed or started; the message says why."""


async def place(m: MemberState, spec: RayClusterSpec) -> None:
    if m.role == "router":
        return
    from ray.util.placement_group import placement_group

    bundles = placement.rank_bundles(spec.pool(m.role))
    m.group = placement_group(bundles, strategy=placement.STRATEGY, name=f"{spec.name}-{m.name}")
    try:
        await get(m.group.ready(), spec.placement_timeout_s)
    except TimeoutError:
        raise StartFailure(
            f"{m.name}: no node could take its placement group {bundles} "
            f"({placement.STRATEGY}) within {spec.placement_timeout_s:g}s: check "
            "`ray status` for nodes with these resources free") from None


async def start(m: MemberState, spec: RayClusterSpec) -> None:
    """The member's supervising actor and its process, until the process is ready."""
    if m.role == "router":
        router = spec.router
        assert router is not None
        m.actor = remote(ProcessActor, placement.router_request(router), None, 0,
                         spread=True).remote(m.name, spec.log_dir)
        m.node = await get(m.actor.node.remote(), spec.placement_timeout_s)
        module, gpus = "router", []
        args = placement.router_args(spec.model, router, spec.host or m.node["ip"],
                                     spec.shutdown_grace_s)
    else:
        pool = spec.pool(m.role)
        bundles = placement.rank_bundles(pool)
        m.actor = remote(ProcessActor, placement.bundle_request(bundles[0]), m.group, 0) \
            .remote(m.name, spec.log_dir)
        m.holders = [remote(RankHolder, placement.bundle_request(b), m.group, i).remote()
                     for i, b in enumerate(bundles) if i > 0 and b.get("GPU")]
        m.node = await get(m.actor.node.remote(), spec.placement_timeout_s)
        gpus = [g for ids in await asyncio.gather(*(get(h.gpu_ids.remote(), CALL_TIMEOUT_S)
                                                    for h in m.holders)) for g in ids]
        module = pool.entry_module
        args = placement.worker_args(spec.model, pool, m.name, spec.host or m.node["ip"],
                                     spec.drain_timeout_s)
    env = {**spec.env, REDIS_URL_ENV: spec.redis_url, CLUSTER_SECRET_ENV: spec.cluster_secret}
    timeout = spec.ready_timeout_s
    m.info = await get(m.actor.start.remote(module, args, env, gpus, timeout), timeout + 30)


async def stop(m: MemberState, grace_s: float) -> str:
    """Stop the member's process (SIGTERM, then SIGKILL after `grace_s`)."""
    try:
        code = await get(m.actor.stop.remote(grace_s), grace_s + 30)
    except Exception as exc:  # noqa: BLE001 — a lost actor has nothing left to stop
        return f"stop: {first_line(exc)}"
    return f"stopped (exit code {code})"


async def get(ref: Any, timeout_s: float) -> Any:
    """The result of a Ray call, awaited without blocking the actor's event loop;
    asyncio.TimeoutError after `timeout_s`."""
    return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout_s)


def remote(cls: type, req: placement.ActorRequest, group: Any, bundle: int,
            spread: bool = False) -> Any:
    """`cls` as a Ray actor asking for `req`, inside `bundle` of `group` when given."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    options: dict[str, Any] = {"num_cpus": req.num_cpus, "num_gpus": req.num_gpus,
                               "resources": req.resources, "max_restarts": 0,
                               "max_concurrency": MAX_CONCURRENCY}
    if group is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=bundle)
    elif spread:
        options["scheduling_strategy"] = "SPREAD"
    return ray.remote(cls).options(**options)


def release(m: MemberState) -> None:
    """Free a member's actors and placement group (its process is gone or going)."""
    import ray
    from ray.util.placement_group import remove_placement_group

    for a in [m.actor, *m.holders]:
        if a is not None:
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001 — already dead
                pass
    m.actor, m.holders = None, []
    if m.group is not None:
        try:
            remove_placement_group(m.group)
        except Exception:  # noqa: BLE001 — already removed
            pass
        m.group = None


def describe(exc: BaseException) -> str:
    """A failure in words: the remote exception's own message, without Ray's traceback."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        exc = cause
    if isinstance(exc, asyncio.TimeoutError):
        return "timed out"
    return str(exc) or type(exc).__name__


def first_line(exc: BaseException) -> str:
    text = describe(exc)
    return text.splitlines()[0] if text else type(exc).__name__
