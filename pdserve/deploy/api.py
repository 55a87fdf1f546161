"""The Python API of a Ray deployment, the one `pdserve ray ...` uses too:

    from pdserve.deploy import Deployment, load_spec
    d = Deployment.up(load_spec("deploy.yaml"), address="auto", detach=True)
    d.status().routers()                  # ["10.0.0.5:50051"]
    d.scale("decode", 4)                  # returns once the pool is ready (wait=False: at once)
    Deployment.connect("pdserve", address="auto").down()   # from any other process

`up` creates the controller actor (`deploy.controller`), detached or owned by this driver, and
waits until every process is ready; a failed start raises `StartupFailed` with the failing
process's last stderr lines, after tearing down what was started. Connecting says clearly what
is wrong: `CannotConnect` (no Ray there, or token auth without its token), `NoDeployment`,
`DeploymentExists`. It calls `ray.init` itself when this process is not connected yet.
"""

from __future__ import annotations

import os
from typing import Any

from pdserve.deploy import schema
from pdserve.deploy.controller import NAMESPACE, Controller
from pdserve.deploy.spec import RayClusterSpec
from pdserve.deploy.status import DeploymentStatus

AUTH_HINT = ("is RAY_AUTH_MODE=token set, with the cluster's token in $RAY_AUTH_TOKEN, "
             "$RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token? Since Ray 2.60 a cluster started "
             "where a token exists requires it)")


class DeployError(RuntimeError):
    """A deployment operation that failed for a reason the operator can act on."""


class CannotConnect(DeployError):
    pass


class NoDeployment(DeployError):
    pass


class DeploymentExists(DeployError):
    pass


class StartupFailed(DeployError):
    pass


def connect_ray(address: str | None = None) -> None:
    """`ray.init` into namespace `pdserve` (nothing if this process is connected already)."""
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS") or "auto"
    try:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False,
                 logging_level="WARNING")
    except ray.exceptions.AuthenticationError as exc:
        raise CannotConnect(f"cannot connect to Ray at {address}: {exc.message} ({AUTH_HINT}")\
            from None
    except ConnectionError as exc:
        raise CannotConnect(
            f"cannot connect to Ray at {address}: {str(exc).splitlines()[0]} (is a cluster "
            "running there: `ray start --head`, or --address / $RAY_ADDRESS? If it is, "
            f"{AUTH_HINT}") from None


HEAD_RESOURCE = "node:__internal_head__"
"""The resource only Ray's head node has: asking for a sliver of it pins an actor there."""


class Deployment:
    """A handle on a running deployment's controller; cheap, any process may hold one."""

    def __init__(self, name: str, actor: Any) -> None:
        self.name = name
        self._actor = actor

    @classmethod
    def up(cls, spec: RayClusterSpec, *, address: str | None = None, detach: bool = False,
           timeout_s: float | None = None) -> Deployment:
        """Start `spec` and wait until every process is ready (`timeout_s`, default the
        spec's placement + ready timeouts). detach=True: the deployment outlives this
        process; else it ends with it."""
        import ray

        connect_ray(address)
        try:
            ray.get_actor(spec.controller_name, namespace=NAMESPACE)
        except ValueError:
            pass
        else:
            raise DeploymentExists(f"a deployment named {spec.name!r} is already running: "
                                   "`pdserve ray status` shows it, `pdserve ray down` stops "
                                   "it, or pick another --name")
        # On the head node, always: its loss ends the Ray cluster anyway (the GCS is there),
        # while any other node may go, and the actors this one owns die with it. A soft
        # affinity to the head was not honoured when this driver's own raylet was another
        # node of the same host: the controller landed there and a node loss took the
        # whole deployment down.
        options: dict[str, Any] = {"name": spec.controller_name, "namespace": NAMESPACE,
                                   "num_cpus": 0, "resources": {HEAD_RESOURCE: 0.001},
                                   "max_restarts": 0}
        if detach:
            options["lifetime"] = "detached"
        actor = ray.remote(Controller).options(**options).remote(schema.dump(spec))
        d = cls(spec.name, actor)
        wait = timeout_s or spec.placement_timeout_s + spec.ready_timeout_s
        result = d._call("wait_ready", wait)
        if not result["ok"]:
            d.down()
            raise StartupFailed(f"deployment {spec.name!r} did not start: {result['error']}")
        return d

    @classmethod
    def connect(cls, name: str = "pdserve", *, address: str | None = None) -> Deployment:
        import ray

        connect_ray(address)
        try:
            actor = ray.get_actor(f"{name}-controller", namespace=NAMESPACE)
        except ValueError:
            raise NoDeployment(f"no pdserve deployment named {name!r} on this Ray cluster "
                               f"(namespace {NAMESPACE!r}): start one with `pdserve ray up`") \
                from None
        return cls(name, actor)

    def status(self) -> DeploymentStatus:
        return schema.load(DeploymentStatus, self._call("status"))

    def scale(self, role: str, replicas: int, *, wait: bool = True,
              timeout_s: float = 600.0) -> dict[str, Any]:
        """Set the size of `role` (router, prefill, decode); with `wait`, return once the
        deployment has converged again (StartupFailed if a new process cannot start)."""
        change = self._call("scale", role, replicas)
        if wait:
            result = self._call("wait_ready", timeout_s)
            if not result["ok"]:
                raise StartupFailed(f"scale {role} to {replicas}: {result['error']}")
        return change

    def wait_ready(self, timeout_s: float = 600.0) -> dict[str, Any]:
        return self._call("wait_ready", timeout_s)

    def logs(self, name: str, lines: int = 40) -> dict[str, Any]:
        return self._call("logs", name, lines)

    def spec(self) -> RayClusterSpec:
        return schema.load(RayClusterSpec, self._call("spec_dict"))

    def down(self) -> list[str]:
        """Stop every process, then the controller; the names stopped."""
        import ray

        try:
            stopped = self._call("down")["stopped"]
        finally:
            try:
                ray.kill(self._actor)
            except Exception:  # noqa: BLE001 — already gone
                pass
            self._wait_gone()
        return stopped

    def _wait_gone(self, timeout_s: float = 30.0) -> None:
        """Until Ray has released the controller's name (ray.kill only starts the kill)."""
        import time

        import ray

        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            try:
                ray.get_actor(f"{self.name}-controller", namespace=NAMESPACE)
            except ValueError:
                return
            time.sleep(0.1)

    def _call(self, method: str, *args: Any) -> Any:
        import ray

        try:
            return ray.get(getattr(self._actor, method).remote(*args))
        except ray.exceptions.RayActorError:
            raise NoDeployment(f"the controller of deployment {self.name!r} is gone (its node "
                               "was lost, or it was stopped)") from None
        except ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, ValueError):
                raise DeployError(str(cause)) from None
            raise
