"""The KV hand-off failing on its own terms, on real processes: leases that run out (the
request moves on and its new decode worker pulls the prompt's KV from the prefill worker that
still holds it) and a stale KV index entry (a pull from a worker that holds nothing only
means computing the prompt)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import redis

from kv_store.index.events import BlockStored, Tier, encode_batch
from kv_store.index.redis_common import Keys, RedisIndexConfig
from pdserve.block_hash import chain_hashes
from pdserve.proto import worker_pb, worker_pb_grpc
from pdserve.tokenizer import Tokenizer
from tests.helpers.checkpoints import VOCAB
from tests.helpers.cluster import (
    eventually,
    start_cluster,
    wait_idle,
    worker_channel,
    worker_stats,
)
from tests.helpers.engine import random_prompts
from tests.helpers.faults import (
    engine_outputs,
    migrations,
    mixed_jobs,
    run_http_jobs,
    run_jobs,
)
from tests.helpers.redis_server import RedisServer, registered_workers, require_redis_server

pytestmark = pytest.mark.timeout(300)


def _counter(address: str, name: str) -> float:
    return worker_stats(address).counters.get(name, 0.0)


def _assert_all_ok(outcomes, expected):
    assert [(o.code, o.details) for o in outcomes if o.code != grpc.StatusCode.OK] == []
    assert [o.tokens for o in outcomes] == expected


def test_a_lease_too_short_for_any_transfer_moves_every_request_on(tiny_llama, tmp_path):
    # Every remote prefill's KV misses its (absurdly short) lease: the decode worker aborts
    # it, the router moves the request on with P's first token, and the new attempt pulls
    # the prompt's KV from the prefill worker's cache instead of recomputing it.
    cluster = start_cluster(tiny_llama, tmp_path, prefill=1, decode=1,
                            worker_args=("--kv-lease-s", "0.001"))
    try:
        jobs = mixed_jobs(random_prompts([100, 180, 260, 340], VOCAB, seed=321), 10)
        http_jobs = mixed_jobs(random_prompts([120, 220], VOCAB, seed=322), 10)
        expected = engine_outputs(tiny_llama, jobs + http_jobs)
        p, d = (cluster.workers(r)[0].info["address"] for r in ("prefill", "decode"))
        outcomes = asyncio.run(run_jobs(cluster.address, jobs, concurrency=2))
        _assert_all_ok(outcomes, expected[:len(jobs)])
        # The OpenAI API shares the flow: its requests move on the same way.
        texts = asyncio.run(run_http_jobs(cluster, http_jobs))
        decode = Tokenizer.from_pretrained(tiny_llama).decode
        assert texts == [(200, decode(e)) for e in expected[len(jobs):]]
        moved = len(jobs) + len(http_jobs)
        assert migrations(cluster, "decode_ended") == moved
        assert _counter(p, "kv_pushes") == moved and _counter(d, "kv_pulled_blocks") > 0
        assert not any(wait_idle(cluster).values())
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def redis_cluster(tiny_llama, tmp_path_factory):
    require_redis_server()
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        c = start_cluster(tiny_llama, tmp_path_factory.mktemp("stale"), prefill=1, decode=1,
                          redis_url=server.url())
        try:
            eventually(lambda: len(registered_workers(server.url())) == 2, "workers register")
            yield c, server
        finally:
            c.stop()


def _claim(server: RedisServer, worker: str, hashes: list[bytes]) -> None:
    """Write into the KV index that `worker` holds these blocks (it does not)."""
    stream = Keys(RedisIndexConfig().namespace).stream
    redis.Redis.from_url(server.url()).xadd(
        stream, {"e": encode_batch([BlockStored(worker, hashes, Tier.DEVICE)])})


def test_a_stale_index_entry_costs_a_failed_pull_not_a_request(redis_cluster, tiny_llama):
    cluster, server = redis_cluster
    p, d = (cluster.workers(r)[0].info["address"] for r in ("prefill", "decode"))
    with worker_channel(d) as ch:
        info = worker_pb_grpc.WorkerStub(ch).GetInfo(worker_pb.InfoRequest(), timeout=10)
    for attempt in range(5):  # until the router has read the claim (it reads in milliseconds)
        jobs = mixed_jobs(random_prompts([200], VOCAB, seed=330 + attempt), 6)
        hashes = chain_hashes(jobs[0].prompt, info.block_size, info.hash_extra)
        _claim(server, p, hashes)  # the prefill worker "holds" the whole prompt
        before = {k: _counter(d, k) for k in ("kv_pulls", "kv_pull_failures")}
        outcomes = asyncio.run(run_jobs(cluster.address, jobs))
        _assert_all_ok(outcomes, engine_outputs(tiny_llama, jobs))
        if _counter(d, "kv_pulls") > before["kv_pulls"]:
            break
    else:
        raise AssertionError("the router never acted on the stale entry")
    assert _counter(d, "kv_pull_failures") == before["kv_pull_failures"] + 1
    assert _counter(p, "kv_pushed_blocks") == 0  # it held nothing: it sent nothing
    assert not any(wait_idle(cluster).values())
