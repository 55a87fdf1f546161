"""`RayCluster` on a local Ray (2 CPUs, 2 logical GPUs) with a real password-protected Redis.

The placement test runs stand-in workers (tests/deploy/fake_worker.py), so it needs nothing
but Ray. The serving test runs real workers and a router that discovers them in Redis
(`router --redis URL` with no worker lists): it is skipped while the router cannot do that.
"""

from __future__ import annotations

import os

import pytest

from pdserve.deploy.spec import PoolSpec, RayClusterSpec, RouterSpec
from tests.helpers.checkpoints import VOCAB
from tests.helpers.cluster import TEST_SECRET, eventually, worker_stats
from tests.helpers.engine import random_prompts
from tests.helpers.redis_server import (
    RedisServer,
    registered_workers,
    require_redis_server,
)

ray = pytest.importorskip("ray", reason="ray is not installed (pip install -e .[ray])")
from pdserve.deploy.ray_cluster import RayCluster  # noqa: E402 — needs ray

pytestmark = pytest.mark.timeout(240)

PASSWORD = "pw-ray-test"
ENV = {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd(),
       "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")}


@pytest.fixture(scope="module")
def local_ray():
    # address="local": always a fresh instance, never a cluster some earlier `ray start` left.
    ray.init(address="local", num_cpus=2, num_gpus=2, include_dashboard=False,
             log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    require_redis_server()
    with RedisServer(tmp_path_factory.mktemp("redis"), password=PASSWORD) as server:
        yield server


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _groups() -> dict[str, dict]:
    """Placement groups by name (the latest of each name)."""
    return {g["name"]: g for g in ray.util.placement_group_table().values()}


def test_tp_ranks_share_a_strict_pack_group_and_see_all_its_gpus(local_ray, redis_server):
    fake = "tests.deploy.fake_worker"
    spec = RayClusterSpec(
        model="/unused", redis_url=redis_server.url(), host="127.0.0.1", router=None, env=ENV,
        prefill=PoolSpec("prefill", tp=2, cpus_per_rank=0.25, gpus_per_rank=1, module=fake),
        decode=PoolSpec("decode", cpus_per_rank=0.25, module=fake),
        ready_timeout_s=5, stop_grace_s=5)
    cluster = RayCluster(spec).start()
    try:
        status = cluster.status()
        (p,), (d,) = status["prefill"], status["decode"]
        assert (p.state, d.state) == ("ready", "ready")
        assert p.gpus == ("0", "1") and d.gpus == ()
        info = cluster.pools["prefill"][0].info
        assert info["cuda_visible_devices"] == "0,1" and info["tp"] == 2
        assert cluster.pools["decode"][0].info["cuda_visible_devices"] == ""
        # The Redis URL reaches the process through its environment, never its command line.
        assert info["has_redis_url"]
        assert PASSWORD not in open(f"/proc/{p.pid}/cmdline").read()
        group = _groups()["pdserve-prefill-0"]
        assert group["strategy"] == "STRICT_PACK" and group["state"] == "CREATED"
        assert len(set(group["bundles_to_node_id"].values())) == 1
        assert [b.get("GPU") for b in group["bundles"].values()] == [1.0, 1.0]
        # Both logical GPUs are taken: a second TP=2 worker cannot be placed, and says so.
        with pytest.raises(RuntimeError, match="placement group"):
            cluster.scale("prefill", 2)
        assert [s.name for s in cluster.status()["prefill"]] == ["prefill-0"]
        assert _groups()["pdserve-prefill-1"]["state"] == "REMOVED"
    finally:
        cluster.stop()
    assert not _alive(p.pid) and not _alive(d.pid)
    assert _groups()["pdserve-prefill-0"]["state"] == "REMOVED"
    assert cluster.status() == {"prefill": [], "decode": []}


def test_the_controller_actor_resizes_a_pool_for_any_driver(local_ray, redis_server):
    from pdserve.deploy.autoscale import AutoscaleConfig, AutoscalePolicy, ScaleRule
    from pdserve.deploy.controller import Controller, RemoteCluster, spec_to_dict

    fake = "tests.deploy.fake_worker"
    spec = RayClusterSpec(
        model="/unused", redis_url=redis_server.url(), host="127.0.0.1", router=None, env=ENV,
        prefill=PoolSpec("prefill", replicas=0, cpus_per_rank=0.25, module=fake),
        decode=PoolSpec("decode", cpus_per_rank=0.25, module=fake), stop_grace_s=5)
    controller = ray.remote(Controller).options(num_cpus=0).remote(spec_to_dict(spec))
    try:
        status = ray.get(controller.start.remote())
        assert status["router"] is None and status["prefill"] == []
        assert [w["name"] for w in status["decode"]] == ["decode-0"]
        assert ray.get(controller.scale.remote("decode", 2)) == ["decode-1"]
        status = ray.get(controller.status.remote())
        assert [(w["name"], w["state"]) for w in status["decode"]] == [
            ("decode-0", "ready"), ("decode-1", "ready")]
        # What `pdserve ray up --autoscale` does each period: a decision through the actor, as
        # plain data. Stand-in workers report no load, so only the bounds move a pool.
        policy = AutoscalePolicy(AutoscaleConfig(prefill=ScaleRule(min_replicas=0, max_replicas=0),
                                                 decode=ScaleRule(min_replicas=3, max_replicas=3)))
        decision = RemoteCluster(controller, ray.get).autoscale_once(policy)
        assert decision.changes() == {"decode": (2, 3)}
        assert decision.reasons == {"prefill": "no load figures", "decode": "bounds [3, 3]"}
        status = ray.get(controller.status.remote())
        assert [w["name"] for w in status["decode"]] == ["decode-0", "decode-1", "decode-2"]
        ray.get(controller.stop.remote())
        assert not any(_alive(w["pid"]) for w in status["decode"])
    finally:
        ray.kill(controller)


def _router_discovers_workers() -> bool:
    from router.__main__ import parse

    try:
        cfg, _ = parse(["--model", "m", "--redis", "redis://127.0.0.1:1/0", "--http-port", "-1"])
    except SystemExit:
        return False
    return bool(getattr(cfg, "discover", False))


def _leases(server: RedisServer) -> dict[str, str]:
    return registered_workers(server.url())


def test_router_serves_while_the_decode_pool_scales(local_ray, redis_server, tiny_llama):
    if not _router_discovers_workers():
        pytest.skip("the router cannot discover workers in Redis yet (router --redis URL "
                    "without --decode)")
    from pdserve.client import Client
    from pdserve.engine import LLM, SamplingParams

    prompts = random_prompts([40, 12], VOCAB, seed=21)  # one via the prefill pool, one local
    greedy = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    expected = [o.token_ids for o in LLM(str(tiny_llama), dtype="float32").generate(
        prompts, SamplingParams(**greedy))]
    worker = {"cpus_per_rank": 0.25, "worker_args": ("--dtype", "float32")}
    spec = RayClusterSpec(
        model=str(tiny_llama), redis_url=redis_server.url(), host="127.0.0.1", env=ENV,
        prefill=PoolSpec("prefill", **worker), decode=PoolSpec("decode", **worker),
        router=RouterSpec(port=0, http_port=-1, num_cpus=0.25, args=("--routing", "round-robin")),
        stop_grace_s=5, cluster_secret=TEST_SECRET)
    cluster = RayCluster(spec).start()
    pids = []
    try:
        client = Client(cluster.router_address)

        def serves() -> list[list[int]]:
            return [client.generate(p, timeout=60, **greedy).token_ids for p in prompts]

        assert serves() == expected
        assert sorted(_leases(redis_server).values()) == ["decode", "prefill"]
        (added,) = cluster.scale("decode", 2)
        new = next(s for s in cluster.status()["decode"] if s.name == added)
        assert _leases(redis_server)[new.address] == "decode"
        # Round-robin: the new worker gets requests once the router has seen it join.
        for _ in range(20):
            assert serves() == expected
            if worker_stats(new.address).counters.get("engine_steps", 0) > 0:
                break
        else:
            raise AssertionError(f"{added} never served a request")
        pid_of = {s.name: s.pid for ws in cluster.status().values() for s in ws}
        pids = [*pid_of.values(), cluster.router.info["pid"]]
        (removed,) = cluster.scale("decode", 1)
        assert not _alive(pid_of[removed])
        eventually(lambda: len(_leases(redis_server)) == 2, f"{removed} unregisters")
        for _ in range(3):
            assert serves() == expected
        client.close()
    finally:
        cluster.stop()
    assert pids and not any(_alive(p) for p in pids)
    eventually(lambda: not _leases(redis_server), "every worker unregisters")
