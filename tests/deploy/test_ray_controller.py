"""The controller on a real Ray cluster (one raylet started by the test, token auth on), with
stand-in workers (tests/deploy/fake_worker.py) so no model loads: `pdserve ray up --detach`
returns and the deployment lives on; a killed process is replaced; `status` answers while a
start is under way; a failed start says why; `down` leaves no process and no actor; the TP
ranks of a worker share one STRICT_PACK group and see exactly its GPUs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.cluster import eventually

ray = pytest.importorskip("ray", reason="ray is not installed (pip install -e .[ray])")

pytestmark = pytest.mark.timeout(300)

FAKE = "tests.deploy.fake_worker"
ROOT = Path(__file__).resolve().parents[2]


def pdserve_ray(nodes, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`pdserve ray ARGS` as an operator runs it: its own process, the cluster's token."""
    return subprocess.run([sys.executable, "-m", "pdserve", "ray", *args],
                          env=env or nodes.env(PYTHONPATH=str(ROOT)), capture_output=True,
                          text=True, timeout=240, cwd=ROOT)


def fake_file(tmp_path: Path, name: str, delay_file: Path, **extra: str) -> Path:
    env = {"PYTHONPATH": str(ROOT), "FAKE_READY_DELAY_FILE": str(delay_file), **extra}
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"""
model: /unused
name: {name}
host: 127.0.0.1
router: null
env: {json.dumps(env)}
prefill: {{replicas: 1, cpus_per_rank: 0.25, module: {FAKE}}}
decode: {{replicas: 1, cpus_per_rank: 0.25, module: {FAKE}}}
reconcile_period_s: 0.5
restart_backoff_s: 0.5
""")
    return path


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _named_actors() -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == "pdserve"]


def test_a_detached_deployment_outlives_its_cli_heals_and_goes_down_clean(ray_head, tmp_path,
                                                                         redis_server):
    from pdserve.deploy import Deployment

    delay = tmp_path / "delay"
    delay.write_text("0")
    done = pdserve_ray(ray_head, "up", "--detach", "-f", str(fake_file(tmp_path, "heal", delay)),
                       "--redis", redis_server.url())
    assert done.returncode == 0, done.stderr
    assert "detached" in done.stdout  # ... and the CLI process is gone: it returned
    d = Deployment.connect("heal")
    st = d.status()
    assert st.converged and [p.name for p in st.processes] == ["prefill-0", "decode-0"]
    for p in st.processes:  # every address of every process, and where its log is
        assert p.grpc == "127.0.0.1:1" and p.metrics == "127.0.0.1:2" and p.node
        assert p.log.endswith(f"{p.name}.log") and _alive(p.pid)
    first = st.of("decode")[0]
    # The password reaches processes through their environment, never a command line.
    assert redis_server.password not in Path(f"/proc/{first.pid}/cmdline").read_text()

    os.kill(first.pid, 9)
    eventually(lambda: [p.name for p in d.status().of("decode") if p.phase == "ready"] ==
               ["decode-1"], "the killed decode worker is replaced", timeout_s=60)
    lost = next(e.what for e in d.status().events if e.what.startswith("decode-0: lost"))
    assert "killed by signal 9" in lost

    # A slow start (30 s "model load"): status answers meanwhile and shows it starting.
    delay.write_text("30")
    d.scale("decode", 2, wait=False)
    took, phases = [], set()
    for _ in range(10):
        t = time.monotonic()
        phases |= {p.phase for p in d.status().of("decode")}
        took.append(time.monotonic() - t)
    assert "starting" in phases or "placing" in phases
    print(f"status while a start runs: max {max(took):.3f}s over {len(took)} calls")
    cli = pdserve_ray(ray_head, "status", "--name", "heal")
    assert cli.returncode == 0 and "decode-2" in cli.stdout and "starting" in cli.stdout

    pids = [p.pid for p in d.status().processes if p.pid > 0]
    down = pdserve_ray(ray_head, "down", "--name", "heal")
    assert down.returncode == 0, down.stderr
    assert "decode-2" in down.stdout  # the one still starting is stopped too
    eventually(lambda: not any(_alive(p) for p in pids), "every process is gone",
               timeout_s=60)
    assert "heal-controller" not in _named_actors()
    gone = pdserve_ray(ray_head, "status", "--name", "heal")
    assert gone.returncode == 1 and "no pdserve deployment named 'heal'" in gone.stderr
    assert not [g for g in ray.util.placement_group_table().values()
                if g["name"].startswith("heal-") and g["state"] != "REMOVED"]


def test_a_lost_controller_takes_its_processes_with_it(ray_head, tmp_path, redis_server):
    from pdserve.deploy import Deployment, NoDeployment

    delay = tmp_path / "delay"
    delay.write_text("0")
    done = pdserve_ray(ray_head, "up", "--detach", "-f", str(fake_file(tmp_path, "orphan", delay)),
                       "--redis", redis_server.url())
    assert done.returncode == 0, done.stderr
    d = Deployment.connect("orphan")
    pids = [p.pid for p in d.status().processes]
    os.kill(ray.get(d._actor.pid.remote()), 9)
    eventually(lambda: not any(_alive(p) for p in pids), "no process outlives the controller",
               timeout_s=60)
    with pytest.raises(NoDeployment):
        Deployment.connect("orphan").status()


def test_a_failed_start_says_why_and_leaves_nothing(ray_head, tmp_path, redis_server):
    delay = tmp_path / "delay"
    delay.write_text("0")
    path = fake_file(tmp_path, "broken", delay,
                     FAKE_FAIL="OSError: [Errno 98] error while attempting to bind on address "
                               "('127.0.0.1', 50051): address already in use")
    done = pdserve_ray(ray_head, "up", "--detach", "-f", str(path), "--redis",
                       redis_server.url())
    assert done.returncode == 1
    assert "did not start" in done.stderr and "address already in use" in done.stderr
    assert "exited with code 1" in done.stderr
    assert "broken-controller" not in _named_actors()


def test_errors_an_operator_can_act_on(ray_head, tmp_path):
    done = pdserve_ray(ray_head, "status", "--name", "nothing-here")
    assert done.returncode == 1 and "start one with `pdserve ray up`" in done.stderr
    assert "Traceback" not in done.stderr
    # Ray retries a refused connect once a second for ~20 s by default; 2 tries say the same.
    no_token = {k: v for k, v in ray_head.env(PYTHONPATH=str(ROOT),
                                              RAY_gcs_server_port_wait_time_s="2").items()
                if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")}
    no_token["HOME"] = str(tmp_path)  # no ~/.ray/auth_token of this machine's user either
    done = pdserve_ray(ray_head, "status", env=no_token)
    assert done.returncode == 1 and "RAY_AUTH_MODE=token" in done.stderr
    assert "Traceback" not in done.stderr
    done = pdserve_ray(ray_head, "up", "--model", "/m", "--redis", "redis://h/0",
                       "--decode-tp", "0")
    assert done.returncode == 2 and "--decode-tp" in done.stderr


def test_tp_ranks_share_a_strict_pack_group_and_see_all_its_gpus(ray_head, redis_server):
    from pdserve.deploy import Deployment, PoolSpec, RayClusterSpec

    env = {"PYTHONPATH": str(ROOT)}
    spec = RayClusterSpec(
        model="/unused", name="tp", redis_url=redis_server.url(), host="127.0.0.1",
        router=None, env=env, reconcile_period_s=0.5, placement_timeout_s=5,
        prefill=PoolSpec("prefill", tp=2, cpus_per_rank=0.25, gpus_per_rank=1, module=FAKE),
        decode=PoolSpec("decode", cpus_per_rank=0.25, module=FAKE))
    d = Deployment.up(spec)  # owned by this driver (not detached)
    try:
        (p,), (dec,) = d.status().of("prefill"), d.status().of("decode")
        assert p.gpus == ("0", "1") and dec.gpus == ()
        group = {g["name"]: g for g in ray.util.placement_group_table().values()}["tp-prefill-0"]
        assert group["strategy"] == "STRICT_PACK" and group["state"] == "CREATED"
        assert len(set(group["bundles_to_node_id"].values())) == 1
        assert [b.get("GPU") for b in group["bundles"].values()] == [1.0, 1.0]
        # Both logical GPUs are taken: a second TP=2 worker cannot be placed, and says so.
        with pytest.raises(Exception, match="no node could take its placement group"):
            d.scale("prefill", 2, timeout_s=60)
        assert [x.name for x in d.status().of("prefill") if x.phase == "ready"] == \
            ["prefill-0"]
    finally:
        d.down()
    assert not _alive(p.pid) and not _alive(dec.pid)


def test_the_serve_app_starts_or_adopts_the_deployment_resizes_it_and_reports_health(
        ray_head, redis_server):
    """What a RayService's Serve replica does (pdserve.deploy.serve_app), without Serve."""
    from pdserve.deploy import Deployment, NoDeployment, schema
    from pdserve.deploy.serve_app import PDServeApp, spec_from_args

    pool = {"cpus_per_rank": 0.25, "module": FAKE}
    spec = spec_from_args({"deployment": {
        "model": "/unused", "name": "served", "host": "127.0.0.1", "router": None,
        "env": {"PYTHONPATH": str(ROOT)}, "reconcile_period_s": 0.5,
        "prefill": pool, "decode": pool}}, environ={"PDSERVE_REDIS_URL": redis_server.url()})
    app = PDServeApp(schema.dump(spec))  # starts it, detached
    assert app.deployment.status().converged
    again = PDServeApp(schema.dump(spec))  # a restarted replica adopts the running one
    def pids(d) -> list[tuple[str, int]]:
        return [(p.name, p.pid) for p in d.status().processes]
    assert pids(again.deployment) == pids(app.deployment)
    app.reconfigure({"decode": 2})
    eventually(lambda: len([p for p in Deployment.connect("served").status().of("decode")
                            if p.phase == "ready"]) == 2, "user_config resizes the pool",
               timeout_s=90)
    with pytest.raises(ValueError, match="unknown role"):
        app.reconfigure({"decoder": 1})
    import asyncio

    body = json.loads(asyncio.run(app()))
    assert body["name"] == "served" and body["targets"]["decode"] == 2
    app.check_health()
    Deployment.connect("served").down()
    with pytest.raises(NoDeployment):
        app.check_health()  # Serve restarts the replica, which starts the deployment again
