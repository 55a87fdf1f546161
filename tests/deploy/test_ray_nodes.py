"""Across nodes: a Ray cluster of three raylets on this host (`ray start --head` plus two
`ray start --address ...`), each with its own custom resources. Each pool lands on the nodes
its resources name, a TP group's ranks on one node; stopping a raylet moves its decode worker
to a node that can hold it while the service keeps answering."""

from __future__ import annotations

import contextlib
import os

import pytest

from tests.deploy.ray_nodes import RayNodes
from tests.deploy.test_ray_controller import ROOT, _alive
from tests.deploy.test_ray_serving import GREEDY, Service
from tests.helpers.checkpoints import VOCAB
from tests.helpers.cluster import eventually
from tests.helpers.engine import random_prompts

ray = pytest.importorskip("ray", reason="ray is not installed (pip install -e .[ray])")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_pools_land_on_their_node_types_and_move_when_a_node_goes(tmp_path, redis_server,
                                                                  tiny_llama):
    from pdserve.deploy import Deployment, PoolSpec, RayClusterSpec, RouterSpec
    from pdserve.engine import LLM, SamplingParams

    prompts = random_prompts([40, 12], VOCAB, seed=5)
    expected = [o.token_ids for o in LLM(str(tiny_llama), dtype="float32").generate(
        prompts, SamplingParams(**GREEDY))]
    with RayNodes(tmp_path) as nodes:
        # The head holds the router, the prefill node type and one spare decode slot; two
        # more nodes hold one decode worker each.
        head = nodes.add(num_cpus=2, resources={"prefill_node": 1, "decode_node": 1})
        nodes.add(num_cpus=1, resources={"decode_node": 1})
        nodes.add(num_cpus=1, resources={"decode_node": 1})
        decode_capable = {n.node_id for n in nodes.nodes if "decode_node" in n.resources}
        worker = {"cpus_per_rank": 0.25, "worker_args": ("--dtype", "float32")}
        spec = RayClusterSpec(
            model=str(tiny_llama), name="nodes", redis_url=redis_server.url(),
            host="127.0.0.1", reconcile_period_s=1,
            env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                 "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")},
            prefill=PoolSpec("prefill", tp=2, resources={"prefill_node": 1}, **worker),
            decode=PoolSpec("decode", replicas=2, resources={"decode_node": 1}, **worker),
            router=RouterSpec(port=0, http_port=-1, num_cpus=0.25))
        with driver_of(nodes):
            d = Deployment.up(spec)
            try:
                st = d.status()
                (p,) = st.of("prefill")
                assert p.node_id == head.node_id  # the only node with prefill_node
                group = {g["name"]: g for g in ray.util.placement_group_table().values()}[
                    "nodes-prefill-0"]
                assert set(group["bundles_to_node_id"].values()) == {head.node_id}  # TP=2
                placed = [x.node_id for x in st.of("decode")]
                assert set(placed) <= decode_capable and len(set(placed)) == 2
                # Stop a worker node that holds a decode worker: it moves to the free slot.
                victim = next(x for x in st.of("decode") if x.node_id != head.node_id)
                with Service(d, prompts, expected) as service:
                    nodes.stop_node(nodes.by_id(victim.node_id).index)
                    eventually(lambda: (lambda s: s.converged and victim.name not in
                                        [x.name for x in s.processes])(d.status()),
                               f"{victim.name} moves off the stopped node", timeout_s=180,
                               period_s=0.5)
                moved = {x.node_id for x in d.status().of("decode")}
                assert victim.node_id not in moved and moved <= decode_capable
                assert len(moved) == 2
                assert not _alive(victim.pid)
                assert not service.errors, service.errors[:3]
                assert service.answered > 0
            finally:
                d.down()


@contextlib.contextmanager
def driver_of(nodes: RayNodes):
    """This process as a driver of `nodes` (with its token), for the Python API."""
    keys = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update({k: nodes.env()[k] for k in keys})
    from ray._raylet import Config

    Config.initialize("")  # Ray read RAY_AUTH_MODE when first imported: read it again
    ray.init(address=nodes.address, namespace="pdserve", log_to_driver=False,
             logging_level="WARNING")
    try:
        yield
    finally:
        ray.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
