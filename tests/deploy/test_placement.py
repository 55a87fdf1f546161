"""What each process asks Ray for and runs, the deployment spec's checks, and the process
supervisor (no Ray needed)."""

from __future__ import annotations

import os
import sys

import pytest

from pdserve.deploy import placement, process
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
                    "prefill-3", "--tp", "2", "--threads", "3", "--dtype", "bfloat16"]
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
])
def test_specs_are_validated_with_the_field_named(make, field):
    with pytest.raises(ValueError, match=field):
        make()


def test_a_stop_outlasts_a_workers_drain():
    from pdserve.serving import worker_base

    if not hasattr(worker_base, "DrainConfig"):
        pytest.skip("workers do not drain on SIGTERM in this tree")
    drain = worker_base.DrainConfig()
    spec = RayClusterSpec(model="/m", redis_url="redis://h/0")
    assert spec.stop_grace_s > drain.notice_s + drain.grace_s


def test_constants_spelled_out_match_the_workers():
    from pdserve.serving.security import CLUSTER_SECRET_ENV
    from pdserve.serving.worker_base import READY_PREFIX
    from pdserve.serving.worker_options import REDIS_URL_ENV

    assert process.READY_PREFIX == READY_PREFIX
    assert process.REDIS_URL_ENV == REDIS_URL_ENV
    assert process.CLUSTER_SECRET_ENV == CLUSTER_SECRET_ENV


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


def test_the_spec_crosses_to_the_controller_as_plain_data_and_back():
    from pdserve.deploy.controller import spec_from_dict, spec_to_dict

    spec = RayClusterSpec(model="/m", redis_url="redis://h:1/0", host="10.0.0.2",
                          prefill=PoolSpec("prefill", tp=2, resources={"pdserve_prefill": 1},
                                           worker_args=("--dtype", "bfloat16")),
                          router=RouterSpec(args=("--routing", "kv")))
    d = spec_to_dict(spec)
    plain = (str, int, float, bool, type(None), list, tuple, dict)

    def walk(x):
        assert isinstance(x, plain), type(x)
        for v in (x.values() if isinstance(x, dict) else x if isinstance(x, list | tuple)
                  else ()):
            walk(v)

    walk(d)
    assert spec_from_dict(d) == spec
    assert spec_from_dict({**d, "router": None}).router is None


def test_pdserve_ray_parses_up_and_scale():
    import argparse

    from pdserve.deploy.cli import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    a = p.parse_args(["up", "--model", "/m", "--redis", "redis://h/0", "--decode", "3",
                      "--decode-tp", "2", "--gpus-per-rank", "1"])
    assert (a.ray_cmd, a.decode, a.decode_tp, a.gpus_per_rank) == ("up", 3, 2, 1.0)
    a = p.parse_args(["scale", "--role", "prefill", "--replicas", "0"])
    assert (a.role, a.replicas, a.address) == ("prefill", 0, "auto")
    with pytest.raises(SystemExit):
        p.parse_args(["scale", "--role", "both", "--replicas", "1"])
