"""Across nodes: a Ray cluster of three raylets on this host (`ray start --head` plus two
`ray start --address ...`), each with its own custom resources. Each pool lands on the nodes
its resources name, a TP group's ranks on one node; a raylet that crashes (its whole session
killed at once) has its decode worker moved to a node that can hold it while the service keeps
answering.

Everything talks to the cluster as an operator does, from processes of its own (`pdserve ray`
commands, one-off drivers): a driver in this process would attach to one of the raylets, and
stopping that one would take the driver (and what it owns) with it."""

from __future__ import annotations

import json
import os

import pytest

from pdserve.deploy import schema
from pdserve.deploy.status import DeploymentStatus
from tests.deploy.ray_nodes import RayNodes
from tests.deploy.test_ray_controller import ROOT, _alive, pdserve_ray
from tests.deploy.test_ray_serving import GREEDY, Service
from tests.helpers.checkpoints import VOCAB
from tests.helpers.cluster import eventually
from tests.helpers.engine import random_prompts

pytest.importorskip("ray", reason="ray is not installed (pip install -e .[ray])")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def deploy_file(tmp_path, model) -> str:
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")}
    worker = "cpus_per_rank: 0.25, worker_args: [--dtype, float32]"
    path = tmp_path / "nodes.yaml"
    path.write_text(f"""
model: {model}
name: nodes
host: 127.0.0.1
env: {json.dumps(env)}
reconcile_period_s: 1
prefill: {{tp: 2, resources: {{prefill_node: 1}}, {worker}}}
decode: {{replicas: 2, resources: {{decode_node: 1}}, {worker}}}
router: {{port: 0, http_port: -1, num_cpus: 0.25, resources: {{router_node: 1}}}}
""")
    return str(path)


def status(nodes: RayNodes, failures: list[str] | None = None) -> DeploymentStatus | None:
    """The deployment's status from a `pdserve ray status` of its own, or None when that
    command failed (e.g. it met the raylet being stopped: ask again); why goes to
    `failures`."""
    done = pdserve_ray(nodes, "status", "--json", "--name", "nodes")
    if done.returncode != 0:
        if failures is not None:
            failures.append(f"exit {done.returncode}: {done.stderr.strip()[-500:]}")
        return None
    return schema.load(DeploymentStatus, json.loads(done.stdout))


def settled_status(nodes: RayNodes) -> DeploymentStatus:
    """A status, asking again while the command fails (it may meet a raylet going away)."""
    got: list[DeploymentStatus] = []

    def answered() -> bool:
        s = status(nodes)
        got.extend([s] if s is not None else [])
        return s is not None
    eventually(answered, "`pdserve ray status` answers", timeout_s=120, period_s=0.5)
    return got[-1]


def test_pools_land_on_their_node_types_and_move_when_a_node_goes(tmp_path, redis_server,
                                                                  tiny_llama):
    from pdserve.engine import LLM, SamplingParams

    prompts = random_prompts([40, 12], VOCAB, seed=5)
    expected = [o.token_ids for o in LLM(str(tiny_llama), dtype="float32").generate(
        prompts, SamplingParams(**GREEDY))]
    with RayNodes(tmp_path) as nodes:
        # The head holds the router, the prefill node type and one spare decode slot; two
        # more nodes hold one decode worker each.
        head = nodes.add(num_cpus=2, resources={"prefill_node": 1, "decode_node": 1,
                                                "router_node": 1})
        nodes.add(num_cpus=1, resources={"decode_node": 1})
        nodes.add(num_cpus=1, resources={"decode_node": 1})
        decode_capable = {n.node_id for n in nodes.nodes if "decode_node" in n.resources}
        up = pdserve_ray(nodes, "up", "--detach", "-f", deploy_file(tmp_path, tiny_llama),
                         "--redis", redis_server.url())
        assert up.returncode == 0, up.stderr[-3000:]
        try:
            st = settled_status(nodes)
            (p,), (r,) = st.of("prefill"), st.of("router")
            assert p.node_id == head.node_id == r.node_id  # the only prefill_node, router_node
            groups = nodes.query("{g['name']: sorted(set(g['bundles_to_node_id'].values())) "
                                  "for g in ray.util.placement_group_table().values() "
                                  "if g['state'] == 'CREATED'}")
            assert groups["nodes-prefill-0"] == [head.node_id]  # both TP ranks on one node
            # The controller is on the head whichever raylet the `up` driver talked to: the
            # head's loss ends the cluster anyway, any other node may go.
            assert nodes.query("ray.get(ray.get_actor('nodes-controller', namespace="
                                "'pdserve').node_id.remote())") == head.node_id
            placed = [x.node_id for x in st.of("decode")]
            assert set(placed) <= decode_capable and len(set(placed)) == 2
            # Crash a worker node that holds a decode worker: it moves to the free slot.
            victim = next(x for x in st.of("decode") if x.node_id != head.node_id)
            routers = st.routers()
            with Service(lambda: routers, prompts, expected) as service:
                nodes.stop_node(nodes.by_id(victim.node_id).index, grace_s=0)

                last: list[DeploymentStatus] = []
                failures: list[str] = []

                def moved() -> bool:
                    s = status(nodes, failures)  # a process of its own each time: seconds a look
                    # A deployment that is gone does not come back: say so now, not in 8 min.
                    assert s is not None or "no pdserve deployment" not in failures[-1], \
                        f"the deployment is gone: {failures[-1]}\ncontroller log:\n" + \
                        nodes.actor_log("Controller")
                    last[:] = [s] if s is not None else last
                    return s is not None and s.converged and victim.name not in [
                        x.name for x in s.processes]
                try:
                    eventually(moved, f"{victim.name} moves off the stopped node",
                               timeout_s=480, period_s=1.0)
                except AssertionError as exc:
                    from pdserve.deploy.cli import format_status

                    raise AssertionError(
                        f"{exc}; last status:\n" +
                        (format_status(last[0]) if last else "none") +
                        f"\nstatus failures ({len(failures)}): {failures[-3:]}"
                        "\ncontroller log:\n" + nodes.actor_log("Controller")) from None
            now = {x.node_id for x in settled_status(nodes).of("decode")}
            assert victim.node_id not in now and now <= decode_capable and len(now) == 2
            assert not _alive(victim.pid)
            assert not service.errors, service.errors[:3]
            assert service.answered > 0
        finally:
            pdserve_ray(nodes, "down", "--name", "nodes")
