"""The controller: a named Ray actor that owns a `RayCluster`, so that `pdserve ray scale` (or
any Ray driver) can resize the pools of a deployment another process started.

    pdserve ray up ...      creates `pdserve-controller` in namespace `pdserve`, starts the
                            cluster through it, and stops it on Ctrl-C (the actor is not
                            detached: the deployment lives as long as that command)
    pdserve ray scale ...   looks the actor up and calls `scale`
    pdserve ray up --autoscale
                            runs `autoscale_loop` in the driver against `RemoteCluster`, which
                            calls the actor's `autoscale_once` (the hysteresis state stays in
                            the actor's `RayCluster`)

Arguments and results are plain data: the spec as a dict (`spec_to_dict`), statuses as dicts,
the autoscaling config and decisions as dicts (`*_to_dict` / `*_from_dict` below).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from pdserve.deploy.autoscale import (
    AutoscaleConfig,
    AutoscalePolicy,
    AutoscaleState,
    Decision,
    PoolTrend,
    ScaleRule,
)
from pdserve.deploy.spec import PoolSpec, RayClusterSpec, RouterSpec

NAME = "pdserve-controller"
NAMESPACE = "pdserve"


def spec_to_dict(spec: RayClusterSpec) -> dict[str, Any]:
    return dataclasses.asdict(spec)


def spec_from_dict(d: dict[str, Any]) -> RayClusterSpec:
    def pool(p: dict[str, Any]) -> PoolSpec:
        return PoolSpec(**{**p, "worker_args": tuple(p["worker_args"])})

    router = d.get("router")
    return RayClusterSpec(**{
        **d, "prefill": pool(d["prefill"]), "decode": pool(d["decode"]),
        "router": None if router is None else RouterSpec(**{**router,
                                                            "args": tuple(router["args"])})})


def autoscale_config_to_dict(config: AutoscaleConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)


def autoscale_config_from_dict(d: dict[str, Any]) -> AutoscaleConfig:
    return AutoscaleConfig(prefill=ScaleRule(**d["prefill"]), decode=ScaleRule(**d["decode"]))


def decision_to_dict(decision: Decision) -> dict[str, Any]:
    return dataclasses.asdict(decision)


def decision_from_dict(d: dict[str, Any]) -> Decision:
    trends = {role: PoolTrend(**t) for role, t in d["state"]["trends"].items()}
    return Decision(targets=dict(d["targets"]), state=AutoscaleState(trends),
                    reasons=dict(d["reasons"]), sizes=dict(d["sizes"]))


class Controller:
    """Runs inside Ray (`ray.remote(Controller)`); one per deployment."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from pdserve.deploy.ray_cluster import RayCluster

        self.cluster = RayCluster(spec_from_dict(spec))

    def start(self) -> dict[str, Any]:
        self.cluster.start()
        return self.status()

    def scale(self, role: str, replicas: int) -> list[str]:
        return self.cluster.scale(role, replicas)

    def check(self) -> list[str]:
        return self.cluster.check()

    def autoscale_once(self, config: dict[str, Any]) -> dict[str, Any]:
        """One decision of an `AutoscalePolicy` with this config, applied."""
        policy = AutoscalePolicy(autoscale_config_from_dict(config))
        return decision_to_dict(self.cluster.autoscale_once(policy))

    def status(self) -> dict[str, Any]:
        pools = {role: [dataclasses.asdict(s) for s in workers]
                 for role, workers in self.cluster.status().items()}
        router = None if self.cluster.router is None else {
            "address": self.cluster.router_address, "http_address": self.cluster.http_address}
        return {"router": router, **pools}

    def stop(self) -> None:
        self.cluster.stop()


class RemoteCluster:
    """The driver's handle on a controller actor, shaped like `RayCluster.autoscale_once`, so
    `autoscale_loop` runs the same against either. `get` resolves a call's result (`ray.get`:
    no timeout, since a scale-up waits for model loads)."""

    def __init__(self, actor: Any, get: Callable[[Any], Any]) -> None:
        self._actor = actor
        self._get = get

    def autoscale_once(self, policy: AutoscalePolicy) -> Decision:
        config = autoscale_config_to_dict(policy.config)
        return decision_from_dict(self._get(self._actor.autoscale_once.remote(config)))
