"""Redis index: restarts that lose every key, AUTH, late routers, foreign stream entries.

Each test owns its `redis-server` (some kill it). Skipped when redis-server is not installed.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace

import msgpack
import pytest
import redis.asyncio as aioredis

from kv_store.index import BlockRecorder, BlockStored, KVIndexConfigError, Tier
from kv_store.index.redis_common import Keys
from kv_store.index.redis_index import RedisKVIndex
from tests.helpers.redis_server import RedisServer, require_redis_server
from tests.kv_store.test_index import eventually, fast_config, hashes, keep_beating, leading

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def server(tmp_path):
    require_redis_server()
    with RedisServer(tmp_path / "redis", password="s3cret:/@") as srv:
        yield srv


def indexes(url: str, ns: str = "t") -> tuple[RedisKVIndex, RedisKVIndex]:
    return (RedisKVIndex(url, fast_config(ns, follow=False)),
            RedisKVIndex(url, fast_config(ns, follow=True)))


def _background_tasks_alive(*indexes: RedisKVIndex) -> bool:
    tasks = [t for t in asyncio.all_tasks() if t.get_name().startswith("kv-")]
    return len(tasks) == sum(1 + 2 * (i.follower is not None) for i in indexes) and not any(
        t.done() for t in tasks)


def test_redis_restarting_empty_is_survived_by_workers_and_routers(server):
    h = hashes(10)

    async def main():
        loop_errors = []
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: loop_errors.append(ctx))
        worker, router = indexes(server.url())
        await router.start()
        await worker.start()
        rec = BlockRecorder("w")
        await worker.register("w", {"role": "decode"}, ttl_s=2.0, snapshot=rec.snapshot)
        await worker.register("leaving", {}, ttl_s=2.0)
        beats = asyncio.create_task(keep_beating(worker, "w"))
        for x in h[:6]:
            rec.stored(x, Tier.DEVICE)
        await worker.publish(rec.drain())
        await eventually(lambda: leading(router, h) == {"w": 6})
        announced = worker.publisher.announcements

        server.kill()
        # Nothing raises while Redis is gone; the router keeps answering from what it knows.
        for x in h[6:8]:
            rec.stored(x, Tier.DEVICE)
        rec.removed(h[5], Tier.DEVICE)
        await worker.publish(rec.drain())
        await worker.heartbeat("w")
        await worker.unregister("leaving")  # returns without delivering, delivered later
        assert await worker.flush(timeout_s=0.3) is False
        await eventually(lambda: not router.follower.connected, what="router noticing")
        assert leading(router, h) == {"w": 6}
        assert await router.workers() == {"w": {"role": "decode"}, "leaving": {}}

        server.start()  # same port, no keys at all
        # The worker re-registers with its snapshot: blocks 0-4 (5 was removed meanwhile).
        await eventually(lambda: leading(router, h) == {"w": 5}, what="recovery")
        await eventually(lambda: worker.publisher.announcements > announced)
        await eventually(lambda: router.workers(), what="the unregister delivered")
        assert await router.workers() == {"w": {"role": "decode"}}
        assert await worker.flush(timeout_s=10)
        # Live updates flow again after the recovery.
        rec.stored(h[5], Tier.HOST)
        await worker.publish(rec.drain())
        await eventually(lambda: leading(router, h) == {"w": 8})
        assert _background_tasks_alive(worker, router)
        beats.cancel()
        await worker.close()
        await router.close()
        assert loop_errors == []

    asyncio.run(asyncio.wait_for(main(), 45))


def test_data_loss_without_a_disconnect_is_noticed_through_the_generation_token(server):
    h = hashes(4)

    async def main():
        worker, router = indexes(server.url())
        await router.start()
        await worker.start()
        rec = BlockRecorder("w")
        await worker.register("w", {}, ttl_s=30, snapshot=rec.snapshot)
        for x in h:
            rec.stored(x, Tier.DEVICE)
        await worker.publish(rec.drain())
        await eventually(lambda: leading(router, h) == {"w": 4})
        client = aioredis.Redis.from_url(server.url())
        await client.flushdb()  # e.g. an operator's FLUSHDB or a failover to an empty replica
        rec.removed(h[3], Tier.DEVICE)
        rec.drain()  # lost with nobody to tell: only the snapshot can carry it
        await worker.heartbeat("w")
        await eventually(lambda: leading(router, h) == {"w": 3}, what="re-registration")
        assert await client.exists(Keys("t").lease("w")) == 1
        await client.aclose()
        await worker.close()
        await router.close()

    asyncio.run(asyncio.wait_for(main(), 45))


def test_an_overflowing_backlog_falls_back_to_the_snapshot(server):
    h = hashes(40)

    async def main():
        url = server.url()
        worker = RedisKVIndex(url, replace(fast_config("t", False), max_pending_hashes=10))
        router = RedisKVIndex(url, fast_config("t", True))
        await router.start()
        await worker.start()
        rec = BlockRecorder("w")
        await worker.register("w", {}, ttl_s=5, snapshot=rec.snapshot)
        server.kill()
        for x in h:
            rec.stored(x, Tier.DEVICE)
            await worker.publish(rec.drain())  # 40 hashes queued > 10: dropped
        beats = asyncio.create_task(keep_beating(worker, "w"))
        server.start()
        await eventually(lambda: leading(router, h) == {"w": 40}, what="snapshot")
        beats.cancel()
        await worker.close()
        await router.close()

    asyncio.run(asyncio.wait_for(main(), 45))


def test_a_router_started_later_learns_existing_blocks_through_a_resync(server):
    h = hashes(5)

    async def main():
        worker, _ = indexes(server.url())
        await worker.start()
        rec = BlockRecorder("w")
        await worker.register("w", {}, ttl_s=5.0, snapshot=rec.snapshot)
        for x in h:
            rec.stored(x, Tier.DEVICE)
        await worker.publish(rec.drain())
        beats = asyncio.create_task(keep_beating(worker, "w"))
        assert await worker.flush()
        late = RedisKVIndex(server.url(), fast_config("t", follow=True))
        await late.start()
        await eventually(lambda: leading(late, h) == {"w": 5}, what="resync")
        assert late.follower.resyncs_requested >= 1
        beats.cancel()
        await late.close()
        await worker.close()

    asyncio.run(asyncio.wait_for(main(), 45))


def test_a_vanished_lease_key_makes_the_worker_register_again(server):
    async def main():
        worker, router = indexes(server.url())
        await router.start()
        await worker.start()
        await worker.register("w", {"n": 1}, ttl_s=30)
        client = aioredis.Redis.from_url(server.url())
        assert await client.delete(Keys("t").lease("w")) == 1
        await worker.heartbeat("w")
        assert await worker.flush()
        assert await client.pttl(Keys("t").lease("w")) > 0
        await eventually(lambda: router.workers())
        await client.aclose()
        await worker.close()
        await router.close()

    asyncio.run(asyncio.wait_for(main(), 45))


def test_stream_entries_of_a_foreign_version_are_skipped(server):
    h = hashes(2)

    async def main():
        worker, router = indexes(server.url())
        await router.start()
        await worker.start()
        await worker.register("w", {}, ttl_s=30)
        client = aioredis.Redis.from_url(server.url())
        foreign = msgpack.packb({"v": 999, "events": []})
        await client.xadd(Keys("t").stream, {"e": foreign})
        await client.xadd(Keys("t").stream, {"junk": b"x"})
        await worker.publish([BlockStored("w", h)])
        await eventually(lambda: leading(router, h) == {"w": 2})
        assert router.follower.rejected_entries == 2
        await client.aclose()
        await worker.close()
        await router.close()

    asyncio.run(asyncio.wait_for(main(), 45))


@pytest.mark.parametrize("password", ["wrong", None])
def test_bad_credentials_are_a_clear_error_at_startup(server, password):
    async def main():
        index = RedisKVIndex(server.url(password=password), fast_config("t", follow=True))
        with pytest.raises(KVIndexConfigError, match="refused the credentials") as info:
            await index.start()
        assert "s3cret" not in str(info.value)
        assert "wrong" not in str(info.value)

    asyncio.run(asyncio.wait_for(main(), 30))


def test_the_right_password_and_an_acl_user_work(tmp_path):
    require_redis_server()
    with RedisServer(tmp_path / "acl", password="pw-1", username="pdserve") as srv:
        async def main():
            worker, router = indexes(srv.url())
            await router.start()
            await worker.start()
            await worker.register("w", {}, ttl_s=30)
            await eventually(lambda: router.workers())
            with pytest.raises(KVIndexConfigError):
                await RedisKVIndex(srv.url(username="other"), fast_config("t", True)).start()
            await worker.close()
            await router.close()

        asyncio.run(asyncio.wait_for(main(), 30))


def test_an_unreachable_redis_at_startup_degrades_then_recovers(tmp_path):
    require_redis_server()
    srv = RedisServer(tmp_path / "late")  # not started yet

    async def main():
        worker, router = indexes(srv.url())
        await router.start()  # no exception: the index is a hint
        await worker.start()
        await worker.register("w", {}, ttl_s=5)
        await worker.publish([])
        assert await router.workers() == {} and router.match(hashes(1)) == {}
        beats = asyncio.create_task(keep_beating(worker, "w"))
        srv.start()
        await eventually(lambda: router.workers(), what="registration after Redis came up")
        beats.cancel()
        await worker.close()
        await router.close()

    try:
        asyncio.run(asyncio.wait_for(main(), 45))
    finally:
        with contextlib.suppress(Exception):
            srv.kill()


def test_rediss_with_an_acl_user_verifies_the_servers_certificate(tmp_path):
    require_redis_server()
    from pdserve.serving.security.certs import ThrowawayCA

    ca = ThrowawayCA(tmp_path / "ca")
    cert = ca.issue("redis", ("127.0.0.1",))
    with RedisServer(tmp_path / "tls", password="pw-tls", username="pdserve",
                     tls=(ca.ca_path, cert.cert, cert.key)) as srv:
        assert srv.url().startswith("rediss://pdserve:pw-tls@")

        async def main():
            good = replace(fast_config("t", True), tls_ca=ca.ca_path)
            index = RedisKVIndex(srv.url(), good)
            await index.start()
            await index.register("w", {}, ttl_s=30)
            await eventually(lambda: index.workers())
            await index.close()
            other = ThrowawayCA(tmp_path / "other").ca_path  # not the server's CA
            stranger = RedisKVIndex(srv.url(), replace(good, tls_ca=other))
            with pytest.raises(KVIndexConfigError, match="certificate") as err:
                await stranger.start()
            assert "pw-tls" not in str(err.value)

        asyncio.run(asyncio.wait_for(main(), 30))
