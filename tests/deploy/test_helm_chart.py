"""deploy/helm/pdserve, rendered by the real helm for the CPU and the GPU values files (and a
render with every option on): every object passes strict validation, and the pieces hold
together — selectors, Services' ports, Secrets, $(VAR) references, volumes, the flags each
process really takes (parsed by its own parser), probes on the ports servers bind, graces
that outlast the drains, PDBs, spread, NetworkPolicies, GPU requests, hardened containers,
HPA / KEDA metrics that exist, no Secret with a default value, no password on a command line.
No cluster needed."""

from __future__ import annotations

import argparse
import re

import pytest
import yaml

from tests.deploy.k8s_render import (
    CHART,
    RELEASE,
    RenderError,
    by_kind,
    render,
    violations,
)

VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
VALUES = {"cpu": ("values-cpu.yaml",), "gpu": ("values-gpu.yaml",)}
EVERYTHING = ("monitoring.serviceMonitor.enabled=true", "monitoring.podMonitor.enabled=true",
              "decode.autoscaling.kind=keda", "prefill.autoscaling.kind=keda",
              "auth.existingSecret=pdserve-auth", "tls.enabled=true", "tls.secretName=pd-tls",
              "tls.serverName=pdserve-internal", "monitoring.auth.existingSecret=pd-metrics",
              "clusterSecret.existingSecret=pd-cluster", "router.passShutdownGrace=true",
              "prefill.passDrainTimeout=true", "decode.passDrainTimeout=true")
FULL = f"{RELEASE}-pdserve"


@pytest.fixture(scope="module", params=sorted(VALUES))
def objects(request) -> list[dict]:
    return render(*VALUES[request.param])


def pods(objects) -> dict[str, dict]:
    return {name: d["spec"]["template"]["spec"] for name, d in
            by_kind(objects, "Deployment").items()}


def container(objects, name: str) -> dict:
    (c,) = pods(objects)[name]["containers"]
    return c


def env(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def expand(values: list[str]) -> list[str]:
    """$(VAR) replaced by a placeholder (downward API / secret values are unknown here)."""
    return [VAR.sub(lambda m: f"<{m.group(1)}>", v) for v in values]


@pytest.mark.parametrize("values, sets", [(VALUES["cpu"], ()), (VALUES["gpu"], ()),
                                          ((), EVERYTHING),
                                          ((), ("redis.enabled=false",
                                                "redis.external.urlSecret=redis-url"))],
                         ids=["cpu", "gpu", "every-option", "external-redis"])
def test_every_rendered_object_passes_strict_validation(values, sets):
    objs = render(*values, sets=sets)
    assert len(objs) >= 12
    bad = {f"{o['kind']}/{o['metadata']['name']}": v for o in objs if (v := violations(o))}
    assert not bad, bad
    if sets == EVERYTHING:  # the custom resources are there, and were validated too
        kinds = {o["kind"] for o in objs}
        assert {"ServiceMonitor", "PodMonitor", "ScaledObject"} <= kinds


def test_strict_validation_catches_a_misplaced_field(objects):
    d = yaml.safe_load(yaml.safe_dump(by_kind(objects, "Deployment")[f"{FULL}-decode"]))
    d["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    assert violations(d)
    sm = {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
          "metadata": {"name": "x"}, "spec": {"selector": {}, "endpoint": []}}
    assert violations(sm)


def test_selectors_match_their_pods_and_services_find_their_ports(objects):
    deployments = by_kind(objects, "Deployment")
    assert set(deployments) == {f"{FULL}-{c}" for c in ("redis", "router", "prefill", "decode")}
    for name, d in deployments.items():
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert d["spec"]["selector"]["matchLabels"].items() <= labels.items(), name
    for name, svc in by_kind(objects, "Service").items():
        selector = svc["spec"]["selector"].items()
        matched = [d for d in deployments.values()
                   if selector <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matched) == 1, f"Service {name} selects {len(matched)} Deployments"
        ports = matched[0]["spec"]["template"]["spec"]["containers"][0]["ports"]
        names = {p["name"] for p in ports} | {p["containerPort"] for p in ports}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in names, f"Service {name}: {port['targetPort']}"
    prefill, decode = deployments[f"{FULL}-prefill"], deployments[f"{FULL}-decode"]
    assert not (prefill["spec"]["selector"]["matchLabels"].items()
                <= decode["spec"]["template"]["metadata"]["labels"].items())


def test_env_references_and_volumes_resolve(objects):
    secrets = by_kind(objects, "Secret")
    claims = by_kind(objects, "PersistentVolumeClaim")
    for name, pod in pods(objects).items():
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for c in pod["containers"] + pod.get("initContainers", []):
            defined: set[str] = set()
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref and not ref.get("optional"):
                    assert ref["name"] in secrets, f"{name}: no Secret {ref['name']}"
                    assert ref["key"] in secrets[ref["name"]]["data"], f"{name}: {ref}"
                for var in VAR.findall(e.get("value", "")):
                    assert var in defined, f"{name}: {e['name']} uses $({var}) before it is set"
                defined.add(e["name"])
            for var in VAR.findall(" ".join(c.get("command", []) + c.get("args", []))):
                assert var in defined, f"{name}: args use $({var}), which env does not set"
            for mount in c.get("volumeMounts", []):
                assert mount["name"] in volumes, f"{name}: no volume {mount['name']}"
        for v in volumes.values():
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims, name
            if "secret" in v:
                assert v["secret"]["secretName"] in secrets, name


def _worker_options(c: dict):
    from pdserve.serving.worker_options import add_worker_args

    parser = argparse.ArgumentParser(allow_abbrev=False)  # a misspelt flag must not pass
    add_worker_args(parser)
    return parser.parse_args(expand(c["args"]))


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_workers_bind_the_pod_ip_register_in_redis_and_are_probed_on_their_port(objects, role):
    d = by_kind(objects, "Deployment")[f"{FULL}-{role}"]
    c = container(objects, f"{FULL}-{role}")
    assert c["command"] == ["pdserve", f"{role}-worker"]
    a = _worker_options(c)  # every flag is one the worker takes
    e = env(c)
    assert a.host == "<POD_IP>" and a.worker_id == "<POD_NAME>"
    assert e["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert "--redis" not in c["args"]  # the URL, password included, stays in the environment
    assert e["PDSERVE_REDIS_URL"]["value"] == (f"redis://:$(PDSERVE_REDIS_PASSWORD)@{FULL}-redis"
                                               ":6379/0")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert (ports["grpc"], ports["metrics"]) == (a.port, a.metrics_port)
    for probe in ("startupProbe", "readinessProbe"):
        assert c[probe]["grpc"]["port"] == a.port, probe  # grpc.health.v1 on the worker
    # Liveness never asks gRPC health: a draining worker says NOT_SERVING while it finishes
    # its streams, and must not be restarted for it.
    assert c["livenessProbe"]["tcpSocket"]["port"] == a.port
    # Every internal call is authenticated with the cluster secret (a Secret of the release).
    assert e["PDSERVE_CLUSTER_SECRET"]["valueFrom"]["secretKeyRef"]["name"] == f"{FULL}-cluster"
    annotations = d["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == a.metrics_port
    if role == "decode":
        assert ports["kv"] == a.kv_port
    assert e["OMP_NUM_THREADS"]["value"] == str(a.threads)


def test_router_discovers_workers_and_serves_its_ports(objects):
    from router.__main__ import parse

    c = container(objects, f"{FULL}-router")
    assert c["command"] == ["pdserve", "router"]
    cfg, http = parse([*expand(c["args"]), "--redis", "redis://redis:6379/0"])
    assert not cfg.prefill and not cfg.decode  # no static lists: the pools scale on their own
    assert "PDSERVE_REDIS_URL" in env(c)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert (ports["grpc"], ports["http"]) == (cfg.port, http.port)
    for probe in ("startupProbe", "readinessProbe"):
        assert c[probe]["grpc"]["port"] == cfg.port, probe
    assert c["livenessProbe"]["tcpSocket"]["port"] == cfg.port  # not NOT_SERVING while it drains
    svc = by_kind(objects, "Service")[f"{FULL}-router"]
    assert {p["port"] for p in svc["spec"]["ports"]} == {cfg.port, http.port}


def test_graces_outlast_the_drains_and_the_router_leaves_the_service_first(objects):
    from pdserve.deploy.spec import WORKER_DRAIN_NOTICE_S

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for role in ("prefill", "decode"):
        pod = pods(objects)[f"{FULL}-{role}"]
        drain = values[role]["drainTimeoutSeconds"]
        assert pod["terminationGracePeriodSeconds"] > WORKER_DRAIN_NOTICE_S + drain
    router = pods(objects)[f"{FULL}-router"]
    pre = router["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pre > 0
    assert router["terminationGracePeriodSeconds"] > pre + values["router"][
        "shutdownGraceSeconds"]


@pytest.mark.parametrize("sets", [(), EVERYTHING], ids=["default", "every-option"])
def test_the_drain_and_shutdown_flags_reach_the_processes_and_set_the_graces(sets):
    objs = render(sets=(*sets, "decode.drainTimeoutSeconds=120",
                        "router.shutdownGraceSeconds=60", "router.preStopSleepSeconds=7"))
    c = container(objs, f"{FULL}-decode")
    assert c["args"][c["args"].index("--drain-timeout") + 1] == "120"
    assert pods(objs)[f"{FULL}-decode"]["terminationGracePeriodSeconds"] > 122
    p = container(objs, f"{FULL}-prefill")
    assert p["args"][p["args"].index("--drain-timeout") + 1] == "30"
    r = container(objs, f"{FULL}-router")
    assert r["args"][r["args"].index("--shutdown-grace") + 1] == "60"
    assert r["lifecycle"]["preStop"]["sleep"]["seconds"] == 7
    assert pods(objs)[f"{FULL}-router"]["terminationGracePeriodSeconds"] > 7 + 60


def test_the_workers_take_every_flag_the_chart_gives_them():
    import argparse

    from pdserve.serving.worker_options import add_worker_args

    p = argparse.ArgumentParser()
    add_worker_args(p)
    known = {s for a in p._actions for s in a.option_strings}
    for objs in (render(), render(sets=EVERYTHING)):
        for role in ("prefill", "decode"):
            flags = {a for a in container(objs, f"{FULL}-{role}")["args"] if a.startswith("--")}
            assert flags <= known, (role, flags - known)


def test_an_image_without_the_flags_can_switch_them_off():
    objs = render(sets=("decode.passDrainTimeout=false", "router.passShutdownGrace=false"))
    assert "--drain-timeout" not in container(objs, f"{FULL}-decode")["args"]
    assert "--shutdown-grace" not in container(objs, f"{FULL}-router")["args"]


def test_each_component_has_a_pdb_and_spreads_over_nodes(objects):
    pdbs = by_kind(objects, "PodDisruptionBudget")
    deployments = by_kind(objects, "Deployment")
    for component in ("router", "prefill", "decode"):
        pdb = pdbs[f"{FULL}-{component}"]
        assert pdb["spec"]["maxUnavailable"] == 1
        labels = deployments[f"{FULL}-{component}"]["spec"]["template"]["metadata"]["labels"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
        pod = pods(objects)[f"{FULL}-{component}"]
        keys = {t["topologyKey"] for t in pod["topologySpreadConstraints"]}
        assert {"kubernetes.io/hostname", "topology.kubernetes.io/zone"} <= keys
        anti = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
        assert anti[0]["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"


def test_every_container_is_hardened(objects):
    for name, pod in pods(objects).items():
        sc = pod["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0, name
        assert sc["seccompProfile"]["type"] == "RuntimeDefault", name
        assert pod["automountServiceAccountToken"] is False, name
        for c in pod["containers"] + pod.get("initContainers", []):
            csc = c["securityContext"]
            assert csc["allowPrivilegeEscalation"] is False, (name, c["name"])
            assert csc["readOnlyRootFilesystem"] is True, (name, c["name"])
            assert csc["capabilities"]["drop"] == ["ALL"], (name, c["name"])
            assert "limits" in c["resources"] and "requests" in c["resources"], name


def test_network_policies_keep_workers_and_redis_to_the_release(objects):
    policies = by_kind(objects, "NetworkPolicy")
    release = {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/instance": RELEASE}
    workers = policies[f"{FULL}-workers"]["spec"]
    selected = {e["key"]: e["values"] for e in workers["podSelector"]["matchExpressions"]}
    assert selected == {"app.kubernetes.io/instance": [RELEASE],
                        "app.kubernetes.io/component": ["prefill", "decode"]}
    assert workers["policyTypes"] == ["Ingress"]
    own, metrics = workers["ingress"]
    assert own["from"] == [{"podSelector": {"matchLabels": release}}] and "ports" not in own
    assert metrics["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    assert all("ipBlock" not in peer for rule in workers["ingress"] for peer in rule["from"])
    redis = policies[f"{FULL}-redis"]["spec"]
    assert redis["ingress"] == [{"from": [{"podSelector": {"matchLabels": release}}],
                                 "ports": [{"port": "redis", "protocol": "TCP"}]}]
    router = policies[f"{FULL}-router"]["spec"]
    assert {p["port"] for p in router["ingress"][0]["ports"]} == {"grpc", "http"}


def test_gpu_pods_request_their_tp_groups_gpus_and_cpu_pods_none():
    values = yaml.safe_load((CHART / "values-gpu.yaml").read_text())
    gpu = render("values-gpu.yaml")
    for role in ("prefill", "decode"):
        c = container(gpu, f"{FULL}-{role}")
        want = values[role]["tp"] * values[role]["gpusPerRank"]
        assert c["resources"]["requests"]["nvidia.com/gpu"] == want
        assert c["resources"]["limits"]["nvidia.com/gpu"] == want
        assert _worker_options(c).tp == values[role]["tp"]
        pod = pods(gpu)[f"{FULL}-{role}"]
        assert pod["nodeSelector"] == values[role]["nodeSelector"]
        assert pod["tolerations"] == values[role]["tolerations"]
        assert any(m["mountPath"] == "/dev/shm" for m in c["volumeMounts"])
    cpu = render("values-cpu.yaml")
    for role in ("prefill", "decode"):
        c = container(cpu, f"{FULL}-{role}")
        assert "nvidia.com/gpu" not in str(c["resources"])
        assert _worker_options(c).dtype == "float32"


def _leaves(node, path=""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, f"{path}.{k}" if path else k)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _leaves(v, f"{path}[{i}]")
    else:
        yield path, node


def test_no_secret_carries_a_default_value():
    secretish = re.compile(r"(password|token|secret)s?$", re.IGNORECASE)
    for name in ("values.yaml", "values-cpu.yaml", "values-gpu.yaml"):
        for path, value in _leaves(yaml.safe_load((CHART / name).read_text())):
            leaf = path.rsplit(".", 1)[-1]
            if secretish.search(leaf) and isinstance(value, str) and value and \
                    not leaf.endswith(("Secret", "secretName")):
                pytest.fail(f"{name}: {path} holds a secret value ({value!r})")
    # Created at deploy time: a new random password for each install (kept on upgrades by
    # `lookup`), never one in the chart.
    from tests.deploy import k8s_render

    for name, key in ((f"{FULL}-redis", "password"), (f"{FULL}-cluster", "secret")):
        k8s_render._render.cache_clear()
        first = by_kind(render(), "Secret")[name]["data"][key]
        k8s_render._render.cache_clear()
        second = by_kind(render(), "Secret")[name]["data"][key]
        assert first != second and len(first) >= 40, name
    for template in (CHART / "templates").glob("*"):
        assert "requirepass " not in template.read_text().replace("'requirepass %s", ""), \
            template
    # Referenced instead of created: no Secret rendered at all.
    objs = render(sets=("redis.auth.existingSecret=my-redis",
                        "clusterSecret.existingSecret=my-cluster"))
    assert not by_kind(objs, "Secret")
    assert env(container(objs, f"{FULL}-decode"))["PDSERVE_REDIS_PASSWORD"]["valueFrom"][
        "secretKeyRef"]["name"] == "my-redis"


def test_the_redis_password_never_reaches_a_command_line(objects):
    for name, pod in pods(objects).items():
        for c in pod["containers"] + pod.get("initContainers", []):
            line = " ".join(c.get("command", []) + c.get("args", []))
            assert "$(PDSERVE_REDIS_PASSWORD)" not in line and "requirepass $(" not in line, name
    redis = pods(objects)[f"{FULL}-redis"]
    assert redis["containers"][0]["command"] == ["redis-server", "/config/redis.conf"]
    (init,) = redis["initContainers"]
    script = init["command"][-1]
    assert "$(cat /secrets/redis/password)" in script and "requirepass" in script
    config = next(v for v in redis["volumes"] if v["name"] == "config")
    assert config["emptyDir"]["medium"] == "Memory"


def test_external_redis_takes_its_url_from_a_secret():
    objs = render(sets=("redis.enabled=false", "redis.external.urlSecret=redis-url"))
    assert f"{FULL}-redis" not in by_kind(objs, "Deployment")
    assert f"{FULL}-redis" not in by_kind(objs, "NetworkPolicy")
    for role in ("router", "prefill", "decode"):
        ref = env(container(objs, f"{FULL}-{role}"))["PDSERVE_REDIS_URL"]["valueFrom"][
            "secretKeyRef"]
        assert ref == {"name": "redis-url", "key": "url"}
    with pytest.raises(RenderError, match="redis.external.urlSecret"):
        render(sets=("redis.enabled=false",))


def test_tls_mounts_files_the_processes_take_and_the_secrets_are_referenced():
    objs = render(sets=EVERYTHING)
    for role in ("router", "prefill", "decode"):
        c = container(objs, f"{FULL}-{role}")
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        assert mounts["tls"]["readOnly"] and mounts["tls"]["mountPath"] == "/etc/pdserve/tls"
        assert c["args"][c["args"].index("--tls-cert") + 1] == "/etc/pdserve/tls/tls.crt"
        e = env(c)
        assert e["PDSERVE_CLUSTER_SECRET"]["valueFrom"]["secretKeyRef"]["name"] == "pd-cluster"
        assert e["PDSERVE_METRICS_TOKENS"]["valueFrom"]["secretKeyRef"]["name"] == "pd-metrics"
        volumes = {v["name"]: v for v in pods(objs)[f"{FULL}-{role}"]["volumes"]}
        assert volumes["tls"]["secret"]["secretName"] == "pd-tls"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert "tcpSocket" in c[probe], probe  # kubelet's gRPC probe cannot speak TLS
    for role in ("prefill", "decode"):  # the workers' own parser takes every flag
        a = _worker_options(container(objs, f"{FULL}-{role}"))
        assert (a.tls_ca, a.tls_server_name) == ("/etc/pdserve/tls/ca.crt", "pdserve-internal")
    router = container(objs, f"{FULL}-router")["args"]
    assert "--tls-ca" not in router  # the public API asks no client certificate by default
    assert router[router.index("--internal-tls-ca") + 1] == "/etc/pdserve/tls/ca.crt"
    assert env(container(objs, f"{FULL}-router"))["PDSERVE_AUTH_TOKENS"]["valueFrom"][
        "secretKeyRef"]["name"] == "pdserve-auth"
    assert not by_kind(objs, "Secret") or f"{FULL}-cluster" not in by_kind(objs, "Secret")
    for kind, name in (("ServiceMonitor", "router"), ("PodMonitor", "workers")):
        spec = by_kind(objs, kind)[f"{FULL}-{name}"]["spec"]
        (endpoint,) = spec.get("endpoints") or spec["podMetricsEndpoints"]
        assert endpoint["scheme"] == "https"
        assert endpoint["authorization"]["credentials"]["name"] == "pd-metrics"
        assert endpoint["tlsConfig"]["serverName"] == "pdserve-internal"


def test_the_router_takes_every_flag_the_chart_gives_it():
    import contextlib
    import io

    from router.__main__ import parse

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        parse(["--help"])
    usage = out.getvalue()
    for objs in (render(), render(sets=EVERYTHING)):
        for flag in (a for a in container(objs, f"{FULL}-router")["args"] if a.startswith("--")):
            assert re.search(rf"{re.escape(flag)}(?![\w-])", usage), flag


def _worker_metric_names() -> set[str]:
    from pdserve.observability.worker_metrics import WorkerSnapshot, worker_families

    stats = {"num_waiting": 1, "num_running": 1, "queued_prefill_tokens": 5,
             "kv_blocks_used": 1, "kv_blocks_cached": 1, "kv_blocks_total": 4}
    fams = worker_families({"component": "decode", "worker": "w"}, WorkerSnapshot(stats))
    return {f.name for f in fams}


def test_autoscalers_target_the_pools_on_metrics_that_exist(objects):
    adapter = yaml.safe_load((CHART.parent / "prometheus-adapter-values.yaml").read_text())
    rules = adapter["rules"]["custom"]
    exported = _worker_metric_names()
    for rule in rules:
        assert rule["seriesQuery"].split("{")[0].strip("'\" ") in exported
    served = {r["name"]["as"] for r in rules}
    hpas = by_kind(objects, "HorizontalPodAutoscaler")
    for role in ("prefill", "decode"):
        h = hpas[f"{FULL}-{role}"]["spec"]
        assert h["scaleTargetRef"]["name"] in by_kind(objects, "Deployment")
        assert 1 <= h["minReplicas"] <= h["maxReplicas"]
        (m,) = h["metrics"]
        assert m["pods"]["metric"]["name"] in served
        assert h["behavior"]["scaleDown"]["policies"] == [
            {"type": "Pods", "value": 1, "periodSeconds": h["behavior"]["scaleDown"][
                "policies"][0]["periodSeconds"]}]
    assert hpas[f"{FULL}-router"]["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    # Under an HPA the Deployment leaves replicas to it.
    assert "replicas" not in by_kind(objects, "Deployment")[f"{FULL}-decode"]["spec"]
    keda = by_kind(render(sets=EVERYTHING), "ScaledObject")
    for role in ("prefill", "decode"):
        query = keda[f"{FULL}-{role}"]["spec"]["triggers"][0]["metadata"]["query"]
        assert {n for n in re.findall(r"pdserve_\w+", query)} <= exported, query
        assert f'pod=~"{FULL}-{role}-.*"' in query


def test_monitors_select_the_pods_and_ports_that_serve_metrics():
    objs = render(sets=EVERYTHING)
    sm = by_kind(objs, "ServiceMonitor")[f"{FULL}-router"]["spec"]
    assert sm["endpoints"][0]["port"] == "http"
    assert sm["selector"]["matchLabels"].items() <= by_kind(objs, "Service")[
        f"{FULL}-router"]["metadata"]["labels"].items()
    pm = by_kind(objs, "PodMonitor")[f"{FULL}-workers"]["spec"]
    assert pm["podMetricsEndpoints"][0]["port"] == "metrics"


def test_the_values_schema_refuses_a_misspelt_key():
    with pytest.raises(RenderError, match="replica"):
        render(sets=("decode.replica=3",))
    with pytest.raises(RenderError, match="kind"):
        render(sets=("decode.autoscaling.kind=vpa",))
