"""Deploying pdserve on a cluster: the Ray placement and scaling of the two pools
(`ray_cluster.RayCluster`, needs the `ray` extra), their autoscaling policy (`autoscale`, pure)
and the loop that applies it every period (`autoscale_loop`), and the plain data that describes
a deployment (`spec`). Kubernetes manifests live in deploy/k8s/ at the repository root, the
image they run is built by deploy/Dockerfile; the runbooks are in docs/runbooks/.

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
from pdserve.deploy.spec import PoolSpec, RayClusterSpec, RouterSpec

__all__ = ["AutoscaleConfig", "AutoscalePolicy", "AutoscaleState", "Decision", "PoolSpec",
           "RayClusterSpec", "RouterSpec", "ScaleRule", "WorkerLoad"]
