"""KV index contract, one suite run against both implementations (in-process and Redis).

The worker side and the router side are separate index objects for Redis (as in separate
processes) and one object for the local index. Waits poll with a generous timeout: nothing
asserts how long anything takes.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import pytest

from kv_store.index import (
    BlockRecorder,
    BlockRemoved,
    BlockStored,
    KVIndex,
    KVIndexConfigError,
    LocalKVIndex,
    PrefixMatch,
    Tier,
    WorkerGone,
    create_index,
)
from kv_store.index.redis_common import RedisIndexConfig
from kv_store.index.redis_index import RedisKVIndex
from pdserve.block_hash import chain_hashes
from tests.helpers.redis_server import RedisServer, redis_server_binary

pytestmark = pytest.mark.timeout(60)

_namespaces = itertools.count()


def hashes(n: int, seed: int = 0) -> list[bytes]:
    """`n` chained block hashes of a prompt (block size 4) distinct per seed."""
    return chain_hashes([seed * 100_000 + i for i in range(4 * n)], 4)


def fast_config(namespace: str, follow: bool) -> RedisIndexConfig:
    """Short intervals so recovery paths run within a test's time budget."""
    return RedisIndexConfig(namespace=namespace, follow=follow, read_block_ms=100,
                            registry_poll_s=0.05, retry_min_s=0.02, retry_max_s=0.2,
                            socket_timeout_s=2.0, register_wait_s=2.0, close_flush_s=0.5)


async def eventually(check: Callable[[], object | Awaitable[object]], timeout_s: float = 15.0,
                     what: str = "condition"):
    """Poll `check` until it returns a truthy value; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def keep_beating(index: KVIndex, worker_id: str, every_s: float = 0.05) -> None:
    while True:
        await index.heartbeat(worker_id)
        await asyncio.sleep(every_s)


@dataclass
class Backend:
    name: str
    server: RedisServer | None = None

    def make(self) -> tuple[KVIndex, KVIndex]:
        """(worker-side index, router-side index)."""
        if self.server is None:
            index = LocalKVIndex(reap_interval_s=0.02)
            return index, index
        ns = f"test{next(_namespaces)}:{time.time_ns()}"
        return (RedisKVIndex(self.server.url(), fast_config(ns, follow=False)),
                RedisKVIndex(self.server.url(), fast_config(ns, follow=True)))

    def run(self, body: Callable[[KVIndex, KVIndex], Awaitable[object]]) -> object:
        async def main():
            worker, router = self.make()
            await router.start()
            await worker.start()
            try:
                return await asyncio.wait_for(body(worker, router), 45)
            finally:
                await worker.close()
                await router.close()
        return asyncio.run(main())


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    if redis_server_binary() is None:
        yield None
        return
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(params=["local", "redis"])
def backend(request, redis_server) -> Backend:
    if request.param == "local":
        return Backend("local")
    if redis_server is None:
        pytest.skip("redis-server is not on PATH (install it: apt-get install -y redis-server)")
    return Backend("redis", redis_server)


def leading(router: KVIndex, query: list[bytes]) -> dict[str, int]:
    return {w: m.blocks for w, m in router.match(query).items()}


# -- registry ------------------------------------------------------------------------------
def test_register_makes_worker_visible_with_its_info(backend):
    info = {"address": "10.0.0.7:50051", "role": "decode", "tp": 2}

    async def body(worker, router):
        await worker.register("decode-0", info, ttl_s=30)
        assert await eventually(router.workers, what="registration") == {"decode-0": info}
        await worker.register("prefill-0", {"role": "prefill"}, ttl_s=30)
        await eventually(lambda: _has_workers(router, {"decode-0", "prefill-0"}))

    backend.run(body)


async def _has_workers(router: KVIndex, ids: set[str]) -> bool:
    return set(await router.workers()) == ids


def test_heartbeats_keep_the_lease_and_silence_expires_it(backend):
    async def body(worker, router):
        await worker.register("w", {}, ttl_s=1.0)
        await worker.publish([BlockStored("w", hashes(3))])
        await eventually(lambda: leading(router, hashes(3)) == {"w": 3})
        beats = asyncio.create_task(keep_beating(worker, "w"))
        await asyncio.sleep(2.5)  # well past one ttl, renewed all along
        assert "w" in await router.workers()
        assert leading(router, hashes(3)) == {"w": 3}
        beats.cancel()
        await eventually(lambda: _has_workers(router, set()), what="lease expiry")
        assert router.match(hashes(3)) == {}

    backend.run(body)


def test_a_stalled_local_index_blames_no_worker_for_its_own_stall():
    """In one process the heartbeats pass through the index's own event loop: a stall of that
    loop longer than the ttl is the process's silence, not the worker's."""
    async def body():
        index = LocalKVIndex(reap_interval_s=0.05)
        await index.start()
        try:
            await index.register("w", {}, ttl_s=0.4)
            await index.publish([BlockStored("w", hashes(3))])
            beats = asyncio.create_task(keep_beating(index, "w"))
            await asyncio.sleep(0.2)
            time.sleep(1.5)  # the loop does not run: no beat, no reaper tick
            assert "w" in await index.workers()  # judged before any beat could run
            assert leading(index, hashes(3)) == {"w": 3}
            await asyncio.sleep(0.6)  # beats resume: it stays
            assert "w" in await index.workers()
            beats.cancel()  # silence while the loop runs still ends the lease
            await eventually(lambda: _has_workers(index, set()), what="lease expiry")
        finally:
            await index.close()

    asyncio.run(body())


def test_unregister_drops_the_worker_and_its_blocks_at_once(backend):
    async def body(worker, router):
        await worker.register("w", {}, ttl_s=30)
        await worker.publish([BlockStored("w", hashes(4))])
        await eventually(lambda: leading(router, hashes(4)) == {"w": 4})
        await worker.unregister("w")
        await eventually(lambda: _has_workers(router, set()))
        assert router.match(hashes(4)) == {}
        await asyncio.sleep(0.3)  # a few registry polls later it is still gone
        assert await router.workers() == {}

    backend.run(body)


def test_publishing_for_an_unregistered_worker_is_an_error(backend):
    async def body(worker, router):
        with pytest.raises(ValueError, match="not registered"):
            await worker.publish([BlockStored("ghost", hashes(1))])
        with pytest.raises(ValueError, match="not registered"):
            await worker.heartbeat("ghost")

    backend.run(body)


# -- publish / match -----------------------------------------------------------------------
def test_match_counts_leading_blocks_per_worker_and_stops_at_the_first_miss(backend):
    h = hashes(8)

    async def body(worker, router):
        for w in ("a", "b", "c"):
            await worker.register(w, {}, ttl_s=30)
        await worker.publish([
            BlockStored("a", h[:6]),
            BlockStored("b", h[:2] + h[3:5]),   # hole at block 2
            BlockStored("c", h[1:6]),           # lacks the first block: no prefix at all
        ])
        await eventually(lambda: leading(router, h) == {"a": 6, "b": 2})
        assert leading(router, h[:1]) == {"a": 1, "b": 1}
        other = hashes(8, seed=1)
        assert router.match(other) == {}
        assert router.match(other[:1] + h) == {}  # a prompt's first block decides

    backend.run(body)


def test_match_reports_tiers_and_counts_each_block_at_its_fastest_tier(backend):
    h = hashes(5)

    async def body(worker, router):
        await worker.register("a", {}, ttl_s=30)
        await worker.register("b", {}, ttl_s=30)
        await worker.publish([
            BlockStored("a", h[:2], Tier.DEVICE), BlockStored("a", h[2:3], Tier.HOST),
            BlockStored("a", h[3:4], Tier.SSD),
            BlockStored("b", h, Tier.HOST), BlockStored("b", h, Tier.DEVICE),
        ])
        await eventually(lambda: leading(router, h) == {"a": 4, "b": 5})
        m = router.match(h)
        assert m["a"] == PrefixMatch((2, 3, 4))
        assert m["a"].worst_tier is Tier.SSD
        assert [m["a"].blocks_in(t) for t in Tier] == [2, 1, 1]
        assert m["b"] == PrefixMatch((5, 5, 5)) and m["b"].worst_tier is Tier.DEVICE

    backend.run(body)


def test_removal_is_per_tier_and_none_means_every_tier(backend):
    h = hashes(4)

    async def body(worker, router):
        await worker.register("a", {}, ttl_s=30)
        await worker.publish([BlockStored("a", h, Tier.DEVICE),
                              BlockStored("a", h[:2], Tier.HOST)])
        await eventually(lambda: router.match(h).get("a") == PrefixMatch((4, 4, 4)))
        # Demotion of block 0: the host copy remains, the device copy goes.
        await worker.publish([BlockRemoved("a", h[:1], Tier.DEVICE)])
        await eventually(lambda: router.match(h).get("a") == PrefixMatch((0, 4, 4)))
        # Block 2 leaves the worker entirely: the prefix ends before it.
        await worker.publish([BlockRemoved("a", h[2:3], None)])
        await eventually(lambda: router.match(h).get("a") == PrefixMatch((0, 2, 2)))
        await worker.publish([BlockRemoved("a", h[:1], None)])
        await eventually(lambda: router.match(h) == {})

    backend.run(body)


def test_large_batches_are_delivered_in_order(backend):
    h = hashes(5000)

    async def body(worker, router):
        await worker.register("a", {}, ttl_s=30)
        await worker.register("b", {}, ttl_s=30)
        await worker.publish([BlockStored("a", h), BlockStored("b", h[:3000]),
                              BlockRemoved("b", h[2500:3000])])
        await eventually(lambda: leading(router, h) == {"a": 5000, "b": 2500})
        assert router.prefix.num_blocks("b") == 2500

    backend.run(body)


def test_a_lapsed_worker_that_heartbeats_again_comes_back_with_its_snapshot(backend):
    h = hashes(6)

    async def body(worker, router):
        recorder = BlockRecorder("w")
        await worker.register("w", {"role": "decode"}, ttl_s=0.5, snapshot=recorder.snapshot)
        for x in h[:4]:
            recorder.stored(x, Tier.DEVICE)
        await worker.publish(recorder.drain())
        await eventually(lambda: leading(router, h) == {"w": 4})
        await eventually(lambda: router.match(h) == {}, what="lease expiry")
        # While the worker was silent its cache changed; the snapshot carries it over.
        recorder.stored(h[4], Tier.DEVICE)
        recorder.removed(h[3], Tier.DEVICE)
        recorder.drain()
        beats = asyncio.create_task(keep_beating(worker, "w"))
        try:
            await eventually(lambda: leading(router, h) == {"w": 3}, what="re-registration")
            assert await router.workers() == {"w": {"role": "decode"}}
        finally:
            beats.cancel()

    backend.run(body)


def test_registration_arguments_are_validated(backend):
    async def body(worker, router):
        with pytest.raises(ValueError, match="ttl_s"):
            await worker.register("w", {}, ttl_s=0)
        with pytest.raises(ValueError, match="worker_id"):
            await worker.register("has space", {}, ttl_s=1)
        with pytest.raises(ValueError, match="msgpack"):
            await worker.register("w", {"handle": object()}, ttl_s=1)
        with pytest.raises(ValueError, match="block events only"):
            await worker.publish([WorkerGone("w")])
        assert await router.workers() == {}

    backend.run(body)


def test_create_index_picks_the_implementation_from_the_url():
    assert isinstance(create_index(None), LocalKVIndex)
    assert isinstance(create_index("local"), LocalKVIndex)
    index = create_index("redis://:pw@127.0.0.1:1/0", namespace="other", follow=False)
    assert isinstance(index, RedisKVIndex) and "pw" not in repr(index)
    with pytest.raises(KVIndexConfigError, match="redis://"):
        create_index("http://127.0.0.1:6379")
    with pytest.raises(ValueError, match="namespace"):
        create_index("redis://127.0.0.1:1", namespace="a*b")
