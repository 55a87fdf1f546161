"""deploy/kuberay: the RayService and the RayCluster validate strictly against KubeRay's CRD
schema (v1.7.0, vendored), the other objects with kubernetes-validate; the pdserve deployment
they declare loads into the deployment schema, and its pools fit the worker groups: each
pool's custom resource is what its group's raylets offer, a TP group's GPUs fit one pod,
autoscaling bounds fit the group's bounds; token auth is on, the Redis URL comes from a
Secret, the pods are hardened. No cluster needed."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from pdserve.deploy.serve_app import spec_from_args
from pdserve.deploy.spec import RayClusterSpec, load_spec
from tests.deploy import crd_schema
from tests.deploy.k8s_render import violations

KUBERAY = Path(__file__).resolve().parents[2] / "deploy" / "kuberay"
ENV = {"PDSERVE_REDIS_URL": "redis://:pw@redis:6379/0"}


def docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((KUBERAY / name).read_text()) if d]


def cluster_spec(name: str) -> dict:
    (cr,) = [d for d in docs(name) if d["kind"] in ("RayService", "RayCluster")]
    return cr["spec"]["rayClusterConfig"] if cr["kind"] == "RayService" else cr["spec"]


def declared(name: str) -> RayClusterSpec:
    """The pdserve deployment a manifest declares."""
    if name == "rayservice.yaml":
        (svc,) = [d for d in docs(name) if d["kind"] == "RayService"]
        (app,) = yaml.safe_load(svc["spec"]["serveConfigV2"])["applications"]
        assert app["import_path"] == "pdserve.deploy.serve_app:build"
        return spec_from_args(app["args"], environ=ENV)
    (cm,) = [d for d in docs(name) if d["kind"] == "ConfigMap"]
    data = yaml.safe_load(cm["data"]["deploy.yaml"])
    return load_spec(None, data, environ=ENV)


MANIFESTS = ["rayservice.yaml", "raycluster.yaml"]


@pytest.mark.parametrize("name", MANIFESTS)
def test_every_object_validates_strictly(name):
    objs = docs(name)
    assert any(crd_schema.known(o["apiVersion"], o["kind"]) for o in objs)
    bad = {f"{o['kind']}/{o['metadata']['name']}": v for o in objs if (v := violations(o))}
    assert not bad, bad


def test_the_crd_schema_catches_unknown_fields_and_wrong_types():
    (cr,) = [d for d in docs("raycluster.yaml") if d["kind"] == "RayCluster"]
    typo = copy.deepcopy(cr)
    typo["spec"]["workerGroupSpecs"][0]["maxReplica"] = 3
    assert any("maxReplica" in v for v in crd_schema.validate(typo))
    wrong = copy.deepcopy(cr)
    wrong["spec"]["workerGroupSpecs"][0]["replicas"] = "two"
    assert crd_schema.validate(wrong)
    pod = copy.deepcopy(cr)
    pod["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["resource"] = {}
    assert crd_schema.validate(pod)  # the pod template is checked too


def _group_resources(group: dict) -> dict[str, float]:
    raw = group["rayStartParams"].get("resources", '"{}"')
    return json.loads(json.loads(raw))  # KubeRay's quoting: a JSON string holding JSON


def _gpus(group: dict) -> int:
    (c,) = group["template"]["spec"]["containers"]
    return int(c["resources"].get("limits", {}).get("nvidia.com/gpu", 0))


@pytest.mark.parametrize("name", MANIFESTS)
def test_the_declared_pools_fit_their_worker_groups(name):
    spec = declared(name)
    cluster = cluster_spec(name)
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert set(groups) == {"prefill", "decode"}
    for role in ("prefill", "decode"):
        pool, group = spec.pool(role), groups[role]
        offered = _group_resources(group)
        assert pool.resources and set(pool.resources) <= set(offered), role
        per_pod = min(offered[r] / pool.resources[r] for r in pool.resources)
        # A TP group's ranks share one node: one pod must hold all its GPUs.
        assert pool.tp * pool.gpus_per_rank * per_pod <= _gpus(group), role
        assert _gpus(group) > 0  # GPU requests, not comments
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        if spec.autoscale is not None:
            rule = spec.autoscale.rule(role)
            assert rule.max_replicas <= group["maxReplicas"] * per_pod, role
            assert rule.min_replicas <= group["replicas"] * per_pod, role
    head = _group_resources(cluster["headGroupSpec"])
    assert set(spec.router.resources) <= set(head)
    assert spec.router.replicas * spec.router.resources["router_node"] <= head["router_node"]
    assert cluster["enableInTreeAutoscaling"] is True


def test_the_service_and_the_cluster_declare_the_same_deployment():
    assert declared("rayservice.yaml") == declared("raycluster.yaml")


@pytest.mark.parametrize("name", MANIFESTS)
def test_token_auth_secret_redis_url_and_hardened_pods(name):
    cluster = cluster_spec(name)
    assert cluster["authOptions"]["mode"] == "token"
    templates = [cluster["headGroupSpec"]["template"]] + [
        g["template"] for g in cluster["workerGroupSpecs"]]
    for t in templates:
        pod = t["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        for c in pod["containers"]:
            env = {e["name"]: e for e in c["env"]}
            ref = env["PDSERVE_REDIS_URL"]["valueFrom"]["secretKeyRef"]
            assert ref["name"] and "value" not in env["PDSERVE_REDIS_URL"]
            sc = c["securityContext"]
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert sc["allowPrivilegeEscalation"] is False
            assert "PASSWORD" not in json.dumps(c).replace("PDSERVE_REDIS", "")
    (svc,) = [d for d in docs(name) if d["kind"] == "Service"]
    head_labels = cluster["headGroupSpec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= head_labels.items()
    head_ports = {p["name"] for p in cluster["headGroupSpec"]["template"]["spec"][
        "containers"][0]["ports"]}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= head_ports


def test_serve_app_args_name_what_is_wrong():
    from pdserve.deploy.schema import SchemaError

    with pytest.raises(SchemaError, match="give `deployment`"):
        spec_from_args({})
    with pytest.raises(SchemaError, match=r"PoolSpec\(decode\).tp must be > 0"):
        spec_from_args({"deployment": {"model": "/m", "decode": {"tp": 0}}}, environ=ENV)
