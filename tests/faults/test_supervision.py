"""`pdserve up` supervision (`LocalCluster(..., supervise=True)`): a worker or the router
SIGKILLed under load is started again on its ports while the rest keep serving; requests keep
completing with the engine's output, the respawned worker takes requests again, and every
worker ends idle."""

from __future__ import annotations

import asyncio
import signal

import pytest

from pdserve.engine import LLM
from pdserve.launcher import ClusterSpec, LocalCluster
from pdserve.supervisor import RestartPolicy
from tests.helpers.checkpoints import VOCAB
from tests.helpers.cluster import TEST_SECRET, eventually, wait_idle, worker_stats
from tests.helpers.engine import greedy_ids, random_prompts
from tests.helpers.load import greedy_request, run_load, signal_once_streaming

pytestmark = pytest.mark.timeout(420)

PROMPTS = random_prompts([20, 50] * 4, VOCAB, seed=61)


def _steps(address: str) -> float:
    return worker_stats(address).counters.get("engine_steps", 0.0)


def test_killed_processes_come_back_and_the_cluster_keeps_serving(tiny_llama, tmp_path):
    spec = ClusterSpec(model=str(tiny_llama), port=0, num_prefill=1, num_decode=2,
                       threads_per_worker=1, worker_args=("--dtype", "float32"),
                       log_dir=str(tmp_path / "logs"), env={"OMP_NUM_THREADS": "1"},
                       cluster_secret=TEST_SECRET)
    # A first restart 3 s after the exit (not 0.5 s): a window to see the cluster serve
    # while the process is gone.
    cluster = LocalCluster(spec).start(supervise=True, restart=RestartPolicy(3.0))
    expected = greedy_ids(LLM(str(tiny_llama), dtype="float32"), PROMPTS, 200)
    try:
        for name in ("decode-0", "prefill-0", "router"):
            child = cluster.router if name == "router" else next(
                c for c in cluster.children if c.name == name)
            address = child.info["address"]

            async def kill(child=child):
                child.proc.send_signal(signal.SIGKILL)

            # The kill lands once every request streams (not after a fixed pause, which a
            # fast enough cluster finished the load within).
            outcomes, killed_at, _ = asyncio.run(signal_once_streaming(
                cluster.address, [greedy_request(p, 200) for p in PROMPTS], kill, 60))
            assert any(o.in_flight_at(killed_at) for o in outcomes), name
            for o in outcomes:  # a stream cut by the kill fails cleanly; the rest are exact
                assert o.status in ("OK", "UNAVAILABLE"), (name, o.status)
                if o.ok:
                    assert o.token_ids == expected[o.index], name
            if name != "router":
                # The others serve while it is gone (a first request may still be sent to it
                # before the router notices: it fails UNAVAILABLE, and the worker is out).
                fresh = iter(random_prompts([20, 50] * 10, VOCAB, seed=62))
                eventually(lambda f=fresh: asyncio.run(run_load(
                    cluster.address, [greedy_request(next(f), 2)], 1, 30))[0].ok,
                    f"a request completes without {name}", timeout_s=30, period_s=0.0)
                assert child.restarts == 0, f"{name} came back before anything was served"
            eventually(lambda c=child: c.restarts == 1 and c.ready.is_set(),
                       f"{name} is back", timeout_s=120)
            assert child.info["address"] == address  # same port: the router finds it
            if name != "router":
                before = _steps(address)
                fresh = iter(random_prompts([50] * 100, VOCAB, seed=63))  # no cache affinity

                def used_again(a=address, b=before, f=fresh):
                    asyncio.run(run_load(cluster.address, [greedy_request(next(f), 2)], 1, 30))
                    return _steps(a) > b

                eventually(used_again, f"the router uses {name} again", timeout_s=60)
        after = asyncio.run(run_load(cluster.address,
                                     [greedy_request(p, 200) for p in PROMPTS], 4, 60))
        assert [o.token_ids for o in after] == expected
        assert not any(wait_idle(cluster).values())
    finally:
        cluster.stop()
