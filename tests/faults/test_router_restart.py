"""The router dies under load and comes back: its clients see UNAVAILABLE (retryable), the
workers free what the dead router's requests held, and the restarted router serves again at
once, even while a worker of its static list is down."""

from __future__ import annotations

import asyncio
import signal

import pytest

from pdserve.engine import LLM
from tests.helpers.checkpoints import VOCAB
from tests.helpers.cluster import eventually, start_cluster, wait_idle
from tests.helpers.engine import greedy_ids, random_prompts
from tests.helpers.load import greedy_request, run_load, signal_once_streaming

pytestmark = pytest.mark.timeout(300)


def test_router_killed_mid_stream_then_restarted_serves_at_once(tiny_llama, tmp_path):
    cluster = start_cluster(tiny_llama, tmp_path, prefill=1, decode=2)
    try:
        prompts = random_prompts([40] * 8, VOCAB, seed=41)
        requests = [greedy_request(p, 600) for p in prompts]

        async def kill():
            cluster.kill(cluster.router, signal.SIGKILL)

        # The kill lands once every request streams, not after a fixed pause.
        outcomes, killed_at, _ = asyncio.run(signal_once_streaming(
            cluster.address, requests, kill, 60))
        hit = [o for o in outcomes if o.in_flight_at(killed_at)]
        assert hit, "no request was in flight when the router died"
        assert {o.status for o in hit} == {"UNAVAILABLE"}
        assert not any(wait_idle(cluster).values())  # the workers cancelled the dead streams

        # Restart it with one decode worker down and no patience for it: it must serve on
        # its own healthy workers, not wait for the dead one (the start-up wait is a ceiling).
        cluster.kill(cluster.workers("decode")[1], signal.SIGKILL)
        cluster.router.args += ["--start-wait", "3600"]
        cluster.respawn(cluster.router)
        eventually(cluster.router.ready.is_set, "the router announced itself", timeout_s=120)
        again = asyncio.run(run_load(cluster.address,
                                     [greedy_request(p, 8) for p in prompts[:3]], 3, 60))
        assert [o.status for o in again] == ["OK"] * 3
        expected = greedy_ids(LLM(str(tiny_llama), dtype="float32"), prompts[:3], 8)
        assert [o.token_ids for o in again] == expected
        assert not any(wait_idle(cluster).values())
    finally:
        cluster.stop()
