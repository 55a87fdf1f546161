"""The cluster KV index: which worker holds which KV block, in which tier.

    create_index(None)                  in-process `LocalKVIndex` (embedded default)
    create_index("redis://:pw@h:6379/0") `RedisKVIndex` (imported on first use)

Workers: `register` (with a `snapshot` callback, e.g. `BlockRecorder.snapshot`), `heartbeat`
every ttl/3, `publish(recorder.drain())`. Routers: `prefix.match(block_hashes)`, `workers()`.
"""

from __future__ import annotations

from kv_store.index.base import KVIndex, KVIndexConfigError, KVIndexError, SnapshotFn
from kv_store.index.events import (
    VERSION,
    BlockRemoved,
    BlockStored,
    Event,
    EventCodecError,
    Tier,
    WorkerGone,
    WorkerRegistered,
    decode_batch,
    encode_batch,
)
from kv_store.index.local import LocalKVIndex
from kv_store.index.prefix import PrefixIndex, PrefixMatch
from kv_store.index.recorder import BlockRecorder

__all__ = [
    "VERSION", "BlockRecorder", "BlockRemoved", "BlockStored", "Event", "EventCodecError",
    "KVIndex", "KVIndexConfigError", "KVIndexError", "LocalKVIndex", "PrefixIndex",
    "PrefixMatch", "SnapshotFn", "Tier", "WorkerGone", "WorkerRegistered", "create_index",
    "decode_batch", "encode_batch",
]


def create_index(url: str | None = None, **options) -> KVIndex:
    """The index for `url`: None/""/"local" → in-process; redis://, rediss://, unix:// →
    Redis (`options` are `RedisIndexConfig` fields, or `LocalKVIndex` arguments)."""
    if not url or url == "local":
        return LocalKVIndex(**options)
    if url.split("://", 1)[0] in ("redis", "rediss", "unix"):
        from kv_store.index.redis_common import RedisIndexConfig
        from kv_store.index.redis_index import RedisKVIndex

        return RedisKVIndex(url, RedisIndexConfig(**options))
    raise KVIndexConfigError(
        "index url must be empty/'local' or start with redis://, rediss:// or unix://, "
        f"got {url.split('://', 1)[0]!r}://...")
