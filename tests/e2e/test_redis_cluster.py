"""The cluster with the Redis KV index (`--redis`): routing fed by Redis, Redis dying mid-load.

One password-protected `redis-server` and one cluster (1 prefill, 2 decode workers) serve the
module. To prove the router routes on what Redis tells it (and not on its own placements), a
test writes a block event for a prompt nobody has served into the stream by hand: the router
must then send that prompt to the named decode worker and let it prefill locally.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest
import redis

from kv_store.index.events import (
    BlockStored,
    Tier,
    WorkerRegistered,
    decode_batch,
    encode_batch,
)
from kv_store.index.redis_common import Keys, RedisIndexConfig
from pdserve.block_hash import chain_hashes
from pdserve.client import AsyncClient, Client
from pdserve.engine import LLM
from pdserve.proto import worker_pb, worker_pb_grpc
from tests.helpers.checkpoints import VOCAB
from tests.helpers.cluster import eventually, start_cluster, wait_idle, worker_channel, worker_stats
from tests.helpers.engine import greedy_ids, random_prompts
from tests.helpers.redis_server import (
    RedisServer,
    registered_workers,
    require_redis_server,
)

pytestmark = pytest.mark.timeout(180)

PASSWORD = "s3cret:/@pw"
KEYS = Keys(RedisIndexConfig().namespace)
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    require_redis_server()
    with RedisServer(tmp_path_factory.mktemp("redis"), password=PASSWORD) as server:
        yield server


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory, redis_server):
    c = start_cluster(tiny_llama, tmp_path_factory.mktemp("redis-cluster"), prefill=1,
                      decode=2, redis_url=redis_server.url())
    # The router asks every worker to re-publish when it starts; a worker's second
    # registration is that answer. Only then is the index settled: a re-publication wipes
    # whatever a test wrote in a worker's name.
    eventually(lambda: all(n >= 2 for n in _registrations(redis_server, _addresses(c))),
               what="workers answer the router's start-up resync")
    yield c
    c.stop()


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32")


def _redis(server: RedisServer) -> redis.Redis:
    return redis.Redis.from_url(server.url())


def _addresses(cluster, role=None):
    return [c.info["address"] for c in cluster.children if role in (None, c.info["role"])]


def _leases(server: RedisServer) -> dict[str, str]:
    return registered_workers(server.url())


def _stored(server: RedisServer) -> dict[str, set[bytes]]:
    """Worker id → every hash the event stream says it stored (removals ignored)."""
    out: dict[str, set[bytes]] = {}
    for _id, fields in _redis(server).xrange(KEYS.stream):
        for e in decode_batch(fields[b"e"]):
            if isinstance(e, BlockStored):
                out.setdefault(e.worker_id, set()).update(e.hashes)
    return out


def _registrations(server: RedisServer, workers: list[str]) -> list[int]:
    """How many times each worker registered, per the event stream."""
    seen = {w: 0 for w in workers}
    for _id, fields in _redis(server).xrange(KEYS.stream):
        for e in decode_batch(fields[b"e"]):
            if isinstance(e, WorkerRegistered) and e.worker_id in seen:
                seen[e.worker_id] += 1
    return list(seen.values())


def _hashes(cluster, prompt):
    with worker_channel(_addresses(cluster, "decode")[0]) as ch:
        info = worker_pb_grpc.WorkerStub(ch).GetInfo(worker_pb.InfoRequest(), timeout=10)
    return chain_hashes(prompt, info.block_size, info.hash_extra)


def _counter(address, name):
    return worker_stats(address).counters.get(name, 0.0)


def _routes_on_what_redis_says(cluster, server, reference, seed):
    """For each decode worker: announce in the stream that it holds an unseen prompt; the
    router sends the prompt there and prefills it locally (it believes it is cached)."""
    for i, target in enumerate(_addresses(cluster, "decode")):
        prompt = random_prompts([200], VOCAB, seed=seed + i)[0]
        event = BlockStored(target, _hashes(cluster, prompt), Tier.DEVICE)
        _redis(server).xadd(KEYS.stream, {"e": encode_batch([event])})
        time.sleep(1.0)  # the router's follower reads the stream within milliseconds
        before = _counter(target, "local_prefills")
        with Client(cluster.address) as client:
            out = client.generate(prompt, max_tokens=4, **GREEDY)
        assert _counter(target, "local_prefills") == before + 1, target
        assert out.token_ids == greedy_ids(reference, [prompt], 4)[0]


def test_workers_register_by_address_and_publish_their_blocks(cluster, redis_server):
    assert _leases(redis_server) == {c.info["address"]: c.info["role"] for c in cluster.children}
    prompt = random_prompts([100], VOCAB, seed=71)[0]
    with Client(cluster.address) as client:
        client.generate(prompt, max_tokens=4, **GREEDY)
    full = set(_hashes(cluster, prompt))
    eventually(lambda: any(full <= hs for hs in _stored(redis_server).values()),
               what="a worker's stored blocks reach the stream")
    # One consumer of the recorder: with --redis the stats carry no KV events.
    for address in _addresses(cluster):
        with worker_channel(address) as ch:
            stats = worker_pb_grpc.WorkerStub(ch).GetStats(
                worker_pb.StatsRequest(kv_snapshot=True), timeout=10)
        assert stats.kv_events == b""


def test_second_turn_lands_on_its_prefix_with_a_redis_fed_index(cluster, redis_server,
                                                                   reference):
    _routes_on_what_redis_says(cluster, redis_server, reference, seed=80)
    turn1 = random_prompts([200], VOCAB, seed=61)[0]
    decode = _addresses(cluster, "decode")
    with Client(cluster.address) as client:
        out1 = client.generate(turn1, max_tokens=8, **GREEDY)
        hits = {a: _counter(a, "prefix_hit_blocks") for a in decode}
        turn2 = turn1 + out1.token_ids + random_prompts([40], VOCAB, seed=62)[0]
        out2 = client.generate(turn2, max_tokens=8, **GREEDY)
    assert [out1.token_ids, out2.token_ids] == greedy_ids(reference, [turn1, turn2], 8)
    gained = {a: _counter(a, "prefix_hit_blocks") - hits[a] for a in decode}
    assert max(gained.values()) >= 12  # turn 1's 12 full prompt blocks, already there
    assert not any(wait_idle(cluster).values())


def test_redis_killed_mid_load_then_back_empty(cluster, redis_server, reference):
    prompts = random_prompts([20, 50, 90, 130, 170, 210, 40, 110] * 2, VOCAB, seed=90)
    expected = greedy_ids(reference, prompts, 24)
    first_token = asyncio.Event()

    async def one(client, prompt):
        tokens = []
        async for chunk in client.stream(prompt, max_tokens=24, timeout=120, **GREEDY):
            tokens += chunk.token_ids
            first_token.set()
        return tokens

    async def main():
        async with AsyncClient(cluster.address) as client:
            tasks = [asyncio.create_task(one(client, p)) for p in prompts]
            await first_token.wait()
            redis_server.kill()
            unfinished = sum(not t.done() for t in tasks)
            await asyncio.sleep(0.5)
            redis_server.start()  # same port, no data
            return unfinished, await asyncio.gather(*tasks)

    unfinished, got = asyncio.run(main())
    assert unfinished > 0  # requests were in flight when Redis died
    assert got == expected
    # Every worker re-registers under its address, with its block set.
    everyone = {c.info["address"]: c.info["role"] for c in cluster.children}
    eventually(lambda: _leases(redis_server) == everyone, what="workers re-register")
    held = set(_hashes(cluster, prompts[5])[:12])
    eventually(lambda: any(held <= hs for hs in _stored(redis_server).values()),
               what="workers re-publish their blocks")
    _routes_on_what_redis_says(cluster, redis_server, reference, seed=95)
    assert not any(wait_idle(cluster).values())


def test_workers_leave_the_registry_when_the_cluster_stops(cluster, redis_server):
    eventually(lambda: len(_leases(redis_server)) == 3, what="three leases")
    cluster.stop()
    assert all(c.proc.returncode == 0 for c in cluster.children)
    assert _leases(redis_server) == {}  # unregistered, not left to expire


def test_wrong_password_fails_at_startup_with_a_clear_error(tiny_llama, redis_server):
    bad = redis_server.url(password="not-the-password")
    procs = [subprocess.Popen([sys.executable, "-m", module, "--model", str(tiny_llama),
                               *args, "--redis", bad], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
             for module, args in [("decode_worker", ["--dtype", "float32"]),
                                  ("router", ["--decode", "127.0.0.1:1", "--port", "0",
                                              "--http-port", "-1"])]]
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        message = err.decode()
        assert proc.returncode != 0
        assert b"PDSERVE_READY" not in out
        assert "refused the credentials" in message
        assert f":***@127.0.0.1:{redis_server.port}" in message
        assert "not-the-password" not in message
