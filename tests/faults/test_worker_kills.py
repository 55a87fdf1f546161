"""Workers SIGKILLed under load, on one cluster of real processes (2 prefill, 2 decode
workers): no request fails. A dead decode worker's requests continue on the other one from
the tokens already streamed (pulling the prompt's KV where it still is); a dead prefill
worker's requests are retried on the other one, and with no prefill worker left the decode
worker prefills them itself. Outputs equal the engine's, greedy and seeded alike.

Each test kills only what it needs and needs only what survives, so either runs alone.

The workers prefill in chunks of `PREFILL_CHUNK` tokens, so a prompt stays on its prefill
worker for several steps (its KV streaming out layer by layer meanwhile): a kill triggered
by polling the victim lands while it holds requests, and the migrations it causes prove it.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import grpc
import pytest

from pdserve.tokenizer import Tokenizer
from tests.helpers.checkpoints import VOCAB
from tests.helpers.cluster import start_cluster, wait_idle
from tests.helpers.engine import random_prompts
from tests.helpers.faults import (
    FAST_HEARTBEAT,
    engine_outputs,
    migrations,
    mixed_jobs,
    run_http_jobs,
    run_jobs,
    wait_busy,
)

pytestmark = pytest.mark.timeout(300)
PREFILL_CHUNK = 32  # --max-num-batched-tokens: a 300-700 token prompt takes 10-22 steps
LOST = ("prefill_lost", "decode_ended")  # a pending Prefill failed / D lost its transfer


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory):
    c = start_cluster(tiny_llama, tmp_path_factory.mktemp("kills"), prefill=2, decode=2,
                      worker_args=("--max-num-batched-tokens", str(PREFILL_CHUNK)),
                      router_args=FAST_HEARTBEAT)
    yield c
    c.stop()


def _kill_under_load(cluster, jobs, victim, at_least=1, http_jobs=()) -> tuple[list, int]:
    """Run `jobs` over gRPC (and `http_jobs` over the OpenAI API at the same time); SIGKILL
    `victim` once it holds `at_least` requests. Returns the outcomes (gRPC's, then HTTP's
    (status, text) pairs) and how many requests it held just before."""
    held, errors = [], []

    def kill():
        try:
            held.append(wait_busy(victim.info["address"], at_least=at_least))
            cluster.kill(victim, signal.SIGKILL)
        except BaseException as exc:
            errors.append(exc)

    side = threading.Thread(target=kill)
    side.start()
    t0 = time.monotonic()

    async def both():
        grpc_side = run_jobs(cluster.address, jobs, concurrency=8)
        got = await asyncio.gather(grpc_side, run_http_jobs(cluster, list(http_jobs)))
        return got[0] + got[1]

    outcomes = asyncio.run(both())
    side.join(60)
    assert not errors, errors
    assert time.monotonic() - t0 < 120  # nothing hung until a deadline
    return outcomes, held[0]


def _assert_all_ok(outcomes, expected):
    assert [(o.code, o.details) for o in outcomes if o.code != grpc.StatusCode.OK] == []
    assert [o.tokens for o in outcomes] == expected


def test_a_killed_decode_worker_loses_no_request_on_grpc_or_http(cluster, tiny_llama):
    jobs = mixed_jobs(random_prompts([40, 90, 150, 220] * 4, VOCAB, seed=311), 40)
    http_jobs = mixed_jobs(random_prompts([70, 130] * 2, VOCAB, seed=314), 40)
    expected = engine_outputs(tiny_llama, jobs + http_jobs)
    before = migrations(cluster, "decode_lost")
    victim = cluster.workers("decode")[-1]
    outcomes, held = _kill_under_load(cluster, jobs, victim, at_least=2, http_jobs=http_jobs)
    _assert_all_ok(outcomes[:len(jobs)], expected[:len(jobs)])
    decode = Tokenizer.from_pretrained(tiny_llama).decode
    assert outcomes[len(jobs):] == [(200, decode(e)) for e in expected[len(jobs):]]
    assert held >= 2 and migrations(cluster, "decode_lost") - before >= 1
    assert not any(wait_idle(cluster).values())


def test_killed_prefill_workers_lose_no_request(cluster, tiny_llama):
    # Fresh prompts for each kill: a prompt the decode workers already hold is not prefilled
    # remotely at all.
    first, last = (mixed_jobs(random_prompts([300, 500, 700, 400] * 3, VOCAB, seed=s), 8)
                   for s in (312, 313))
    expected = engine_outputs(tiny_llama, first + last)
    # The first one: its requests are retried on the other prefill worker.
    before = _lost(cluster)
    outcomes, held = _kill_under_load(cluster, first, cluster.workers("prefill")[0])
    _assert_all_ok(outcomes, expected[:len(first)])
    assert held >= 1 and _lost(cluster) > before  # it died holding requests: they moved
    # The last one: the decode workers prefill by themselves.
    before = _lost(cluster)
    outcomes, held = _kill_under_load(cluster, last, cluster.workers("prefill")[-1])
    _assert_all_ok(outcomes, expected[len(first):])
    assert held >= 1 and _lost(cluster) > before
    assert not any(wait_idle(cluster).values())


def _lost(cluster) -> float:
    """Migrations of requests a prefill worker was holding (a counter: never missed)."""
    return sum(migrations(cluster, c) for c in LOST)
