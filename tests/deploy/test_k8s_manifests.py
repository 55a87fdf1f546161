"""deploy/k8s: every manifest parses, and the pieces refer to each other correctly — labels
and selectors, Services' ports, Secrets and their keys, $(VAR) references, volumes, the flags
each process really takes, probes on the ports servers bind, HPA targets and metric names.
No cluster needed."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML is not installed")

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


@pytest.fixture(scope="module")
def objects() -> dict[tuple[str, str], dict]:
    """(kind, name) → object, of every resource the kustomization lists."""
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = kustomization["resources"]
    on_disk = sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(listed) == on_disk, "kustomization.yaml must list every manifest"
    out = {}
    for name in listed:
        for doc in _docs(K8S / name):
            assert {"apiVersion", "kind", "metadata"} <= doc.keys(), name
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in out, f"{key} defined twice"
            out[key] = doc
    return out


def _of_kind(objects, kind):
    return {name: o for (k, name), o in objects.items() if k == kind}


def _container(deployment: dict) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def _expand(values: list[str], env: dict[str, dict]) -> list[str]:
    """$(VAR) replaced by a placeholder (downward API / secret values are unknown here)."""
    return [VAR.sub(lambda m: f"<{m.group(1)}>", v) for v in values]


def test_every_file_parses_including_the_extras():
    for path in K8S.rglob("*.yaml"):
        assert _docs(path), f"{path} is empty"


def test_deployment_selectors_match_their_pods_and_services_find_a_deployment(objects):
    deployments = _of_kind(objects, "Deployment")
    assert set(deployments) == {"pdserve-redis", "pdserve-router", "pdserve-prefill",
                                "pdserve-decode"}
    for name, d in deployments.items():
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert d["spec"]["selector"]["matchLabels"].items() <= labels.items(), name
    for name, svc in _of_kind(objects, "Service").items():
        selector = svc["spec"]["selector"].items()
        matched = [d for d in deployments.values()
                   if selector <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matched) == 1, f"Service {name} selects {len(matched)} Deployments"
        ports = _container(matched[0])["ports"]
        names = {p["name"] for p in ports} | {p["containerPort"] for p in ports}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in names, f"Service {name}: {port['targetPort']}"
    # The pools are separate Deployments: no pod of one is selected by the other.
    prefill, decode = deployments["pdserve-prefill"], deployments["pdserve-decode"]
    assert not (prefill["spec"]["selector"]["matchLabels"].items()
                <= decode["spec"]["template"]["metadata"]["labels"].items())


def test_env_references_resolve(objects):
    secrets = _of_kind(objects, "Secret")
    for name, d in _of_kind(objects, "Deployment").items():
        c = _container(d)
        defined: set[str] = set()
        for e in c.get("env", []):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref and not ref.get("optional"):
                assert ref["name"] in secrets, f"{name}: no Secret {ref['name']}"
                assert ref["key"] in secrets[ref["name"]]["stringData"], f"{name}: {ref}"
            for var in VAR.findall(e.get("value", "")):
                assert var in defined, f"{name}: {e['name']} uses $({var}) before it is set"
            defined.add(e["name"])
        for var in VAR.findall(" ".join(c.get("command", []) + c.get("args", []))):
            assert var in defined, f"{name}: args use $({var}), which env does not set"


def test_volumes_and_claims_resolve(objects):
    claims = _of_kind(objects, "PersistentVolumeClaim")
    for name, d in _of_kind(objects, "Deployment").items():
        volumes = {v["name"]: v for v in d["spec"]["template"]["spec"].get("volumes", [])}
        for mount in _container(d).get("volumeMounts", []):
            assert mount["name"] in volumes, f"{name}: no volume {mount['name']}"
        for v in volumes.values():
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims, name


def _worker_options(container: dict):
    from pdserve.serving.worker_options import add_worker_args

    parser = argparse.ArgumentParser(allow_abbrev=False)  # a misspelt flag must not pass
    add_worker_args(parser)
    return parser.parse_args(_expand(container["args"], _env(container)))


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_workers_bind_the_pod_ip_register_in_redis_and_are_probed_on_their_port(objects, role):
    c = _container(objects[("Deployment", f"pdserve-{role}")])
    assert c["command"] == ["pdserve", f"{role}-worker"]  # test_dockerfile.py: roles
    a = _worker_options(c)  # every flag is one the worker takes
    env = _env(c)
    assert a.host == "<POD_IP>"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert "PDSERVE_REDIS_URL" in env and "--redis" not in c["args"]  # password stays in env
    assert env["PDSERVE_REDIS_URL"]["value"].startswith("redis://:$(PDSERVE_REDIS_PASSWORD)@"
                                                      "pdserve-redis:6379/")
    ports = {p["containerPort"] for p in c["ports"]}
    assert a.port in ports and a.metrics_port in ports
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == a.port, probe
    annotations = objects[("Deployment", f"pdserve-{role}")]["spec"]["template"]["metadata"][
        "annotations"]
    assert int(annotations["prometheus.io/port"]) == a.metrics_port
    if role == "decode":
        assert a.kv_port in ports
    from pdserve.serving import worker_base

    # SIGKILL must not land in the middle of a drain (registry notice + --drain-timeout).
    grace = objects[("Deployment", f"pdserve-{role}")]["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"]
    assert grace > worker_base.DrainConfig().notice_s + a.drain_timeout


def test_router_discovers_workers_and_serves_its_ports(objects):
    from router.__main__ import parse

    d = objects[("Deployment", "pdserve-router")]
    c = _container(d)
    assert c["command"] == ["pdserve", "router"]
    cfg, http = parse([*_expand(c["args"], _env(c)), "--redis", "redis://redis:6379/0"])
    assert not cfg.prefill and not cfg.decode  # no static lists: the pools scale on their own
    assert "PDSERVE_REDIS_URL" in _env(c)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert (ports["grpc"], ports["http"]) == (cfg.port, http.port)
    assert c["livenessProbe"]["grpc"]["port"] == cfg.port
    assert c["readinessProbe"]["httpGet"]["port"] in ("http", http.port)
    annotations = d["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == http.port  # /metrics is on the HTTP port
    svc = objects[("Service", "pdserve-router")]
    assert {p["port"] for p in svc["spec"]["ports"]} == {50051, 8000}
    # SIGKILL must not cut the streams the router is finishing: preStop + --shutdown-grace.
    sleep = c["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep[0] == "sleep"
    grace = d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > float(sleep[1]) + cfg.shutdown_grace_s


def _worker_metric_names() -> set[str]:
    """Names of the families a worker exports (from a snapshot with every engine stat)."""
    from pdserve.observability.worker_metrics import WorkerSnapshot, worker_families

    stats = {"num_waiting": 1, "num_running": 1, "queued_prefill_tokens": 5,
             "kv_blocks_used": 1, "kv_blocks_cached": 1, "kv_blocks_total": 4}
    fams = worker_families({"component": "decode", "worker": "w"}, WorkerSnapshot(stats))
    return {f.name for f in fams}


def test_hpas_target_the_pools_on_metrics_that_exist(objects):
    adapter = yaml.safe_load((K8S / "monitoring" / "prometheus-adapter-values.yaml").read_text())
    rules = adapter["rules"]["custom"]
    exported = _worker_metric_names()
    for rule in rules:  # every adapter rule reads a metric the workers export
        series = rule["seriesQuery"].split("{")[0].strip("'\" ")
        assert series in exported, series
    served = {r["name"]["as"] for r in rules}
    hpas = _of_kind(objects, "HorizontalPodAutoscaler")
    assert {h["spec"]["scaleTargetRef"]["name"] for h in hpas.values()} == {
        "pdserve-prefill", "pdserve-decode"}
    for name, h in hpas.items():
        assert ("Deployment", h["spec"]["scaleTargetRef"]["name"]) in objects
        assert 1 <= h["spec"]["minReplicas"] <= h["spec"]["maxReplicas"]
        for m in h["spec"]["metrics"]:
            assert m["pods"]["metric"]["name"] in served, f"{name}: no adapter rule for it"
    assert hpas["pdserve-prefill"]["spec"]["metrics"][0]["pods"]["metric"]["name"] == \
        "pdserve_queued_prefill_tokens"
