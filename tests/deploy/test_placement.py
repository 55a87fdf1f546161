"""What each process asks Ray for and runs, the deployment spec's checks, and the process
supervisor (no Ray needed)."""

from __future__ import annotations

import os
import sys

import pytest

from pdserve.deploy import placement
from pdserve.deploy.process import ManagedProcess, ProcessState
from pdserve.deploy.spec import PoolSpec, RayClusterSpec, RouterSpec

FAKE = [sys.executable, "-m", "tests.deploy.fake_worker", "--model", "m", "--host", "127.0.0.1",
        "--port", "0", "--worker-id", "w", "--tp", "1", "--threads", "1"]
ENV = {**os.environ, "PYTHONPATH": os.getcwd()}


def test_a_worker_gets_one_bundle_per_rank_and_its_pool_label_once():
    pool = PoolSpec("decode", tp=4, cpus_per_rank=2, gpus_per_rank=1,
                    resources={"pdserve_decode": 1})
    bundles = placement.rank_bundles(pool)
    assert bundles == [{"CPU": 2, "GPU": 1, "pdserve_decode": 1}] + [{"CPU": 2, "GPU": 1}] * 3
    assert placement.STRATEGY == "STRICT_PACK"
    req = placement.bundle_request(bundles[0])
    assert (req.num_cpus, req.num_gpus, req.resources) == (2, 1, {"pdserve_decode": 1})
    assert placement.rank_bundles(PoolSpec("prefill", cpus_per_rank=0.5)) == [{"CPU": 0.5}]


def test_command_lines_carry_no_secret_and_the_router_no_worker_list():
    pool = PoolSpec("prefill", tp=2, cpus_per_rank=3, worker_args=("--dtype", "bfloat16"))
    args = placement.worker_args("/m", pool, "prefill-3", "10.0.0.5")
    assert args == ["--model", "/m", "--host", "10.0.0.5", "--port", "0", "--worker-id",
                    "prefill-3", "--metrics-port", "0", "--tp", "2", "--threads", "3",
                    "--dtype", "bfloat16"]
    drained = placement.worker_args("/m", pool, "prefill-3", "h", drain_timeout_s=50)
    assert drained[drained.index("--drain-timeout") + 1] == "50"
    r = placement.router_args("/m", RouterSpec(port=0, http_port=-1, args=("--routing", "kv")),
                              "10.0.0.1")
    assert "--decode" not in r and "--prefill" not in r and "--redis" not in r
    assert r[-2:] == ["--routing", "kv"]
    spec = RayClusterSpec(model="/m", redis_url="redis://:topsecret@h:6379/0",
                          cluster_secret="cluster-secret-value")
    assert "topsecret" not in repr(spec) and "cluster-secret-value" not in repr(spec)
    assert not any("secret" in arg for arg in [*args, *r])


@pytest.mark.parametrize("make, field", [
    (lambda: PoolSpec("both"), "role"),
    (lambda: PoolSpec("decode", tp=0), "tp"),
    (lambda: PoolSpec("decode", replicas=-1), "replicas"),
    (lambda: PoolSpec("decode", resources={"GPU": 1}), "gpus_per_rank"),
    (lambda: RouterSpec(http_port=-2), "http_port"),
    (lambda: RayClusterSpec(model="/m", redis_url=""), "redis_url"),
    (lambda: RayClusterSpec(model="/m", redis_url="redis://h", decode=PoolSpec("prefill")),
     "decode"),
    (lambda: RouterSpec(replicas=-1), "replicas"),
    (lambda: RayClusterSpec(model="/m", redis_url="redis://h", stop_grace_s=20), "stop_grace_s"),
    (lambda: RayClusterSpec(model="/m", redis_url="redis://h", drain_timeout_s=60),
     "stop_grace_s"),
    (lambda: RayClusterSpec(model="/m", redis_url="redis://h", name="a b"), "name"),
])
def test_specs_are_validated_with_the_field_named(make, field):
    with pytest.raises(ValueError, match=field):
        make()


def test_a_stop_outlasts_a_workers_drain():
    from pdserve.serving.drain import DrainConfig

    drain = DrainConfig()
    spec = RayClusterSpec(model="/m", redis_url="redis://h/0")
    assert spec.stop_grace_s > drain.notice_s + drain.grace_s
    assert process_spec_constants() == (drain.notice_s, drain.grace_s)


def process_spec_constants() -> tuple[float, float]:
    from pdserve.deploy import spec

    return spec.WORKER_DRAIN_NOTICE_S, spec.WORKER_DRAIN_TIMEOUT_S


def test_managed_process_reads_ready_and_stops_with_sigterm():
    p = ManagedProcess(FAKE, ENV, name="fake")
    info = p.wait_ready(30)
    assert info["worker_id"] == "w" and p.state is ProcessState.READY
    assert p.stop(grace_s=10) == 0  # the fake exits cleanly on SIGTERM: no SIGKILL needed
    assert p.state is ProcessState.STOPPED


def test_managed_process_reports_an_early_exit():
    p = ManagedProcess([sys.executable, "-c", "import sys; sys.exit(3)"], ENV, name="dies")
    with pytest.raises(RuntimeError, match="dies exited with code 3"):
        p.wait_ready(30)
    assert p.state is ProcessState.EXITED


def test_managed_process_kills_a_child_that_ignores_sigterm():
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " \
           "print('PDSERVE_READY {}', flush=True); time.sleep(60)"
    p = ManagedProcess([sys.executable, "-c", code], ENV, name="stubborn")
    p.wait_ready(30)
    assert p.stop(grace_s=0.5) == -9


def test_managed_process_keeps_the_stderr_tail_and_writes_its_log(tmp_path):
    code = ("import sys; print('loading', flush=True); "
            "print('OSError: [Errno 98] address already in use', file=sys.stderr); sys.exit(1)")
    log = tmp_path / "logs" / "w.log"
    p = ManagedProcess([sys.executable, "-c", code], ENV, name="w", log_path=log)
    with pytest.raises(RuntimeError, match="(?s)w exited with code 1.*address already in use"):
        p.wait_ready(30)
    assert p.tail() == ["OSError: [Errno 98] address already in use"]
    text = log.read_text()
    assert "loading" in text and "address already in use" in text


def test_a_managed_child_dies_with_its_supervisor(tmp_path):
    """SIGKILL of the supervising process (a Ray actor, a lost node) leaves no orphan."""
    import signal
    import subprocess
    import time

    pid_file = tmp_path / "child.pid"
    code = ("import sys, time; from pdserve.deploy.process import ManagedProcess; "
            "p = ManagedProcess([sys.executable, '-c', 'import time; time.sleep(120)'], "
            "{'PATH': ''}, name='c'); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(120)")
    sup = subprocess.Popen([sys.executable, "-c", code], env=ENV)
    try:
        end = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < end:
            time.sleep(0.05)
        child = int(pid_file.read_text())
        assert _alive(child)
        sup.send_signal(signal.SIGKILL)
        sup.wait()
        end = time.monotonic() + 10
        while _alive(child) and time.monotonic() < end:
            time.sleep(0.05)
        assert not _alive(child)
    finally:
        sup.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False
