"""Redis KV index for clusters: lease registry with TTLs, event stream, router-side view.

One `RedisKVIndex` per process. A worker process registers its workers and publishes their
events (`RedisPublisher`); a router follows the stream into its in-memory prefix index
(`RedisFollower`, when `config.follow`). The URL carries AUTH and the database:
`redis://[user]:password@host:port/db` (`rediss://` for TLS).

Redis restarting empty is an expected event, not an error: workers notice (lease gone,
generation token changed, stream id backwards, or simply a connection error followed by
recovery) and re-register with their full block set; routers re-read the new stream and keep
serving from what they knew meanwhile. See `redis_publisher` and `redis_follower`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import redis.asyncio as aioredis

from kv_store.index.base import KVIndex, KVIndexError, SnapshotFn, check_registration
from kv_store.index.events import Event, check_worker_id
from kv_store.index.prefix import PrefixIndex
from kv_store.index.redis_common import (
    TRANSIENT,
    Keys,
    RedisIndexConfig,
    check_url,
    config_error,
    connect,
    ensure_gen,
    masked_url,
    read_leases,
)
from kv_store.index.redis_follower import RedisFollower
from kv_store.index.redis_publisher import RedisPublisher

log = logging.getLogger(__name__)


class RedisKVIndex(KVIndex):
    """The KV index kept in Redis; see the module docstring."""

    def __init__(self, url: str, config: RedisIndexConfig | None = None) -> None:
        self._url = check_url(url)
        self._config = config or RedisIndexConfig()
        self._keys = Keys(self._config.namespace)
        self._client: aioredis.Redis | None = None
        self._publisher: RedisPublisher | None = None
        self._follower: RedisFollower | None = None
        self._no_prefix = PrefixIndex()  # what a non-following index answers

    def __repr__(self) -> str:
        return f"RedisKVIndex({masked_url(self._url)!r}, namespace={self._config.namespace!r})"

    # -- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        if self._client is not None:
            return
        client = connect(self._url, self._config)
        gen, resync = await self._probe(client)
        self._client = client
        self._publisher = RedisPublisher(client, self._keys, self._config)
        self._publisher.start(gen, resync)
        if self._config.follow:
            self._follower = RedisFollower(client, self._keys, self._config)
            self._follower.start()

    async def _probe(self, client: aioredis.Redis) -> tuple[bytes | None, object]:
        """First contact: bad credentials raise; an unreachable Redis only degrades."""
        try:
            await client.ping()
            gen = await ensure_gen(client, self._keys)
            return gen, await client.get(self._keys.resync)
        except TRANSIENT as exc:
            if (err := config_error(exc, self._url)) is not None:
                await client.aclose()
                raise err from None
            log.warning("KV index: Redis at %s unreachable at startup (%s); continuing "
                        "without index information and retrying", masked_url(self._url), exc)
            return None, None

    async def close(self) -> None:
        if self._client is None:
            return
        if self._publisher is not None:
            if self._publisher.down_since is None:
                await self._publisher.flush(self._config.close_flush_s)
            await self._publisher.stop()
        if self._follower is not None:
            await self._follower.stop()
        await self._client.aclose()
        self._client = self._publisher = self._follower = None

    # -- worker side ---------------------------------------------------------------------
    async def register(self, worker_id: str, info: Mapping[str, Any], ttl_s: float,
                       snapshot: SnapshotFn | None = None) -> None:
        check_worker_id(worker_id)
        check_registration(info, ttl_s)
        await self._pub().register(worker_id, info, ttl_s, snapshot)

    async def heartbeat(self, worker_id: str) -> None:
        await self._pub().heartbeat(worker_id)

    async def unregister(self, worker_id: str) -> None:
        await self._pub().unregister(worker_id)

    async def publish(self, events: Sequence[Event]) -> None:
        await self._pub().publish(events)

    async def flush(self, timeout_s: float = 5.0) -> bool:
        return await self._pub().flush(timeout_s)

    def _pub(self) -> RedisPublisher:
        if self._publisher is None:
            raise KVIndexError("RedisKVIndex is not started (call start() first)")
        return self._publisher

    # -- router side ---------------------------------------------------------------------
    async def workers(self) -> dict[str, dict[str, Any]]:
        if self._follower is not None:
            return self._follower.view.workers()
        if self._client is None:
            raise KVIndexError("RedisKVIndex is not started (call start() first)")
        try:
            leases = await read_leases(self._client, self._keys)
        except TRANSIENT:
            return {}  # no information
        return {w: dict(reg.info) for w, (reg, _) in leases.items()}

    @property
    def prefix(self) -> PrefixIndex:
        return self._follower.view.prefix if self._follower is not None else self._no_prefix

    # -- observability (tests, metrics) --------------------------------------------------
    @property
    def follower(self) -> RedisFollower | None:
        return self._follower

    @property
    def publisher(self) -> RedisPublisher | None:
        return self._publisher
