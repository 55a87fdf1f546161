"""Deploying pdserve on a cluster.

Ray: the declarative schema of a deployment (`spec`, loaded from YAML or flags by `schema` /
`flags`), the controller actor that owns and reconciles it (`controller`; its pure plan in
`reconcile`, the Ray calls of one member in `members`), the actors that supervise each
process (`actors`, `process`), the Python API (`api.Deployment`) that `pdserve ray ...`
(`cli`) uses too, and the autoscaling policy
(`autoscale`, pure) with its cadence (`autoscale_loop`). Kubernetes lives at the repository
root: the Helm chart in deploy/helm/pdserve, KubeRay manifests in deploy/kuberay, the image in
deploy/Dockerfile; runbooks in docs/runbooks/.

Nothing here imports Ray at import time: `import pdserve.deploy` works without it.
"""

from pdserve.deploy.autoscale import (
    AutoscaleConfig,
    AutoscalePolicy,
    AutoscaleState,
    Decision,
    ScaleRule,
    WorkerLoad,
)
from pdserve.deploy.spec import PoolSpec, RayClusterSpec, RouterSpec, load_spec


def __getattr__(name: str):
    # The API imports the controller, which is Ray-free at import time too, but keep the
    # package import minimal: resolve it on first use.
    if name in ("Deployment", "StartupFailed", "NoDeployment", "CannotConnect",
                "DeploymentExists", "DeployError"):
        from pdserve.deploy import api

        return getattr(api, name)
    raise AttributeError(name)


__all__ = ["AutoscaleConfig", "AutoscalePolicy", "AutoscaleState", "CannotConnect",
           "Decision", "DeployError", "Deployment", "DeploymentExists", "NoDeployment",
           "PoolSpec", "RayClusterSpec", "RouterSpec", "ScaleRule", "StartupFailed",
           "WorkerLoad", "load_spec"]
