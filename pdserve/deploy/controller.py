"""The controller: a named Ray actor that owns a `RayCluster`, so that `pdserve ray scale` (or
any Ray driver) can resize the pools of a deployment another process started.

    pdserve ray up ...      creates `pdserve-controller` in namespace `pdserve`, starts the
                            cluster through it, and stops it on Ctrl-C (the actor is not
                            detached: the deployment lives as long as that command)
    pdserve ray scale ...   looks the actor up and calls `scale`

Arguments and results are plain data: the spec as a dict (`spec_to_dict`), statuses as dicts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

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

    def status(self) -> dict[str, Any]:
        pools = {role: [dataclasses.asdict(s) for s in workers]
                 for role, workers in self.cluster.status().items()}
        router = None if self.cluster.router is None else {
            "address": self.cluster.router_address, "http_address": self.cluster.http_address}
        return {"router": router, **pools}

    def stop(self) -> None:
        self.cluster.stop()
