"""pdserve as a Ray Serve application, so a KubeRay `RayService` can declare a deployment in its
`serveConfigV2` (deploy/kuberay/rayservice.yaml):

    applications:
      - name: pdserve
        import_path: pdserve.deploy.serve_app:build
        args: {deployment: {model: /models/model, decode: {replicas: 2}, ...}}
        deployments:
          - name: PDServeApp
            user_config: {prefill: 1, decode: 2}     # pool sizes, changed in place

Serve runs one replica of `PDServeApp`. It does not carry the requests (the pdserve routers
do, on their own ports); it owns the pdserve deployment's lifecycle on the RayService's
cluster: on start it adopts the detached controller of that name, or starts one from
`args.deployment` (the schema of `deploy.spec`, the Redis URL from $PDSERVE_REDIS_URL);
`reconfigure` applies `user_config`'s sizes through the controller (no restart);
`check_health` fails while the controller is gone, so Serve, and KubeRay's health of the
RayService, see a broken deployment; GET / answers the deployment's status as JSON.

The class is plain Python (tests drive it without Serve); `build` applies `serve.deployment`,
so only a RayService image needs Ray Serve installed (`ray[serve]`).
"""

from __future__ import annotations

import json
from typing import Any

from pdserve.deploy import schema
from pdserve.deploy.spec import load_spec


def spec_from_args(args: dict[str, Any], environ: dict[str, str] | None = None):
    """The deployment an application's `args` declare: `args["deployment"]`, a mapping of the
    deployment schema (or `args["file"]`, a YAML path inside the image / a mounted volume)."""
    if not isinstance(args, dict) or not ({"deployment", "file"} & args.keys()):
        raise schema.SchemaError("serve_app args: give `deployment` (the deployment's fields) "
                                 "or `file` (a deployment YAML path)")
    over = {k: v for k, v in (args.get("deployment") or {}).items()}
    return load_spec(args.get("file"), over, environ)


class PDServeApp:
    def __init__(self, spec_dict: dict[str, Any]) -> None:
        from pdserve.deploy.api import Deployment, NoDeployment
        from pdserve.deploy.spec import RayClusterSpec

        self.spec = schema.load(RayClusterSpec, spec_dict)
        try:
            self.deployment = Deployment.connect(self.spec.name)  # a restarted replica adopts
        except NoDeployment:
            self.deployment = Deployment.up(self.spec, detach=True)

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Pool sizes from the RayService's user_config, e.g. {"prefill": 1, "decode": 4}
        (roles not named keep their size); returns once the controller has the targets."""
        for role, replicas in (user_config or {}).items():
            if role not in ("router", "prefill", "decode"):
                raise ValueError(f"user_config: unknown role {role!r} (router, prefill, "
                                 "decode)")
            self.deployment.scale(role, int(replicas), wait=False)

    def check_health(self) -> None:
        """Raises while the deployment's controller is gone (Serve then restarts this replica,
        which starts the deployment again)."""
        self.deployment.status()

    async def __call__(self, request: Any = None) -> str:
        return json.dumps(schema.dump(self.deployment.status()))


def build(args: dict[str, Any]):
    """Serve's application builder (`import_path: pdserve.deploy.serve_app:build`)."""
    from ray import serve

    spec = spec_from_args(args)
    app = serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0},
                           health_check_period_s=10, health_check_timeout_s=30)(PDServeApp)
    return app.bind(schema.dump(spec))
