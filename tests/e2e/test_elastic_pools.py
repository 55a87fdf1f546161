"""Elastic pools: a router in discovery mode (`--redis`, no worker lists) follows the worker
registry while the cluster scales up and down under load.

One `redis-server` and one cluster (1 prefill + 1 decode worker at start, round-robin routing
so that a new worker's share is certain) serve the module; the tests run in file order and
each starts from whatever decode workers the previous one left.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest
import redis

from kv_store.index.redis_common import Keys, RedisIndexConfig
from pdserve.client import AsyncClient, Client, Unavailable
from pdserve.engine import LLM
from pdserve.serving.ready import READY_PREFIX
from tests.helpers.checkpoints import VOCAB
from tests.helpers.cluster import start_cluster, wait_idle, worker_stats
from tests.helpers.engine import greedy_ids, random_prompts
from tests.helpers.redis_server import RedisServer, require_redis_server

pytestmark = pytest.mark.timeout(120)

GREEDY = {"temperature": 0.0, "ignore_eos": True}
KEYS = Keys(RedisIndexConfig().namespace)
# Output tokens of the requests in flight on the stopping worker: enough to outlast its
# notice period (2 s), so they finish while its server already refuses new calls (prompt +
# output stay within the checkpoint's 1024 positions).
LONG = 900
HEAD = 24


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    require_redis_server()
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory, redis_server):
    c = start_cluster(tiny_llama, tmp_path_factory.mktemp("elastic"), prefill=1, decode=1,
                      router_args=("--routing", "round-robin"), redis_url=redis_server.url())
    yield c
    c.stop()


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32")


def _requests_served(address: str) -> float:
    counters = worker_stats(address).counters
    return counters.get("local_prefills", 0.0) + counters.get("remote_prefills", 0.0)


def _in_flight(address: str) -> int:
    s = worker_stats(address)
    return s.num_running + s.num_waiting


def _registered(server: RedisServer, address: str) -> bool:
    return redis.Redis.from_url(server.url()).exists(KEYS.lease(address)) == 1


def _decode_workers(cluster, n: int):
    """The cluster's decode workers, after starting enough to have `n`."""
    while len(cluster.workers("decode")) < n:
        cluster.add_worker("decode")
    return cluster.workers("decode")


def test_router_started_without_worker_lists_serves_what_it_discovers(cluster, reference):
    assert cluster.router.info["discovery"] is True
    prompts = random_prompts([12, 70], VOCAB, seed=1)  # one local, one remote prefill
    with Client(cluster.address, max_retries=0) as client:
        got = [client.generate(p, max_tokens=8, **GREEDY).token_ids for p in prompts]
    assert got == greedy_ids(reference, prompts, 8)
    assert not any(wait_idle(cluster).values())


def test_a_decode_worker_added_later_joins_the_pool(cluster, redis_server, reference):
    new = cluster.add_worker("decode")
    address = new.info["address"]
    assert _registered(redis_server, address)
    prompt = random_prompts([40], VOCAB, seed=2)[0]
    expected = greedy_ids(reference, [prompt], 4)[0]
    end = time.monotonic() + 30
    with Client(cluster.address, max_retries=0) as client:
        while _requests_served(address) == 0:  # round-robin: every other request, once in
            assert time.monotonic() < end, "the router never routed to the new worker"
            assert client.generate(prompt, max_tokens=4, **GREEDY).token_ids == expected
    assert not any(wait_idle(cluster).values())


def test_stopping_a_decode_worker_finishes_its_requests_and_loses_none(cluster, redis_server,
                                                                         reference):
    pair = _decode_workers(cluster, 2)[:2]
    long_prompts = random_prompts([20, 24, 28, 32], VOCAB, seed=3)
    short_prompts = random_prompts([16, 18, 22, 26, 30, 34], VOCAB, seed=4)
    # Greedy, so the reference's first HEAD tokens are the long outputs' first HEAD tokens
    # (the whole 900 would take the single-process engine a minute).
    long_heads = greedy_ids(reference, long_prompts, HEAD)
    short_expected = greedy_ids(reference, short_prompts, 4)

    async def collect(client, prompt, max_tokens, started=None):
        tokens, reason = [], None
        async for chunk in client.stream(prompt, max_tokens=max_tokens, timeout=60, **GREEDY):
            tokens += chunk.token_ids
            reason = chunk.finish_reason
            if started is not None:
                started.set()
        assert reason == "length" and len(tokens) == max_tokens
        return tokens

    async def main():
        loop = asyncio.get_running_loop()
        async with AsyncClient(cluster.address, max_retries=0) as client:
            events = [asyncio.Event() for _ in long_prompts]
            long = [asyncio.create_task(collect(client, p, LONG, e))
                    for p, e in zip(long_prompts, events, strict=True)]
            await asyncio.gather(*(e.wait() for e in events))
            # They are mid-stream now. The victim is the worker holding more of them: the
            # router's choice, not always an even split (a worker just added may not have
            # been seen yet), so asking for a fixed one made the test fail when it held none.
            loads = await loop.run_in_executor(
                None, lambda: [_in_flight(w.info["address"]) for w in pair])
            first, other = pair if loads[0] >= loads[1] else pair[::-1]
            stopping = loop.run_in_executor(None, cluster.stop_worker, first)
            short = []
            for p in short_prompts:  # new requests while the victim drains
                short.append(await collect(client, p, 4))
            return first, other, max(loads), await stopping, await asyncio.gather(*long), short

    first, other, busy, code, long_got, short_got = asyncio.run(main())
    victim = first.info["address"]
    assert busy > 0  # the victim had requests in flight when it was told to stop
    assert code == 0  # it drained and exited on its own
    assert [t[:HEAD] for t in long_got] == long_heads and short_got == short_expected
    assert not _registered(redis_server, victim)  # unregistered, not left to expire
    assert first not in cluster.workers("decode") and other in cluster.workers("decode")
    with Client(cluster.address, max_retries=0) as client:  # the pool is down to the other worker
        before = _requests_served(other.info["address"])
        for p, want in zip(short_prompts[:2], short_expected[:2], strict=True):
            assert client.generate(p, max_tokens=4, **GREEDY).token_ids == want
        assert _requests_served(other.info["address"]) == before + 2
    assert not any(wait_idle(cluster).values())


def test_a_router_with_no_worker_of_its_model_starts_and_answers_unavailable(
        cluster, tiny_llama, redis_server, tmp_path):
    log = tmp_path / "router.log"

    def warnings() -> list[str]:
        return [x for x in log.read_text().splitlines()
                if "ignored" in x and "another-model" in x]

    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "router", "--model", str(tiny_llama), "--port", "0",
             "--http-port", "-1", "--redis", redis_server.url(), "--discover-wait", "0",
             "--model-id", "another-model"], stdout=subprocess.PIPE, stderr=err)
        try:
            line = proc.stdout.readline().decode()
            assert line.startswith(READY_PREFIX), line
            info = json.loads(line[len(READY_PREFIX):])
            end = time.monotonic() + 20
            while len(warnings()) < len(cluster.children):  # it has read the registry
                assert time.monotonic() < end, "the registry's workers were never seen"
                time.sleep(0.1)
            with Client(info["address"], max_retries=0) as client:
                for _ in range(2):  # the registry's workers serve another model: ignored
                    with pytest.raises(Unavailable, match="no healthy decode worker"):
                        client.generate([5, 6, 7], max_tokens=2)
            time.sleep(2.0)  # a couple more reconciliations
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    assert proc.returncode == 0
    assert len(warnings()) == len(cluster.children)  # once per worker, not per reconcile
