"""What both sides of the Redis index share: configuration, key layout, connection, helpers.

Keys (all under `namespace`):

    {ns}:lease:{worker_id}  the worker's registration (an encoded WorkerRegistered batch) with a
                            TTL; heartbeats renew it with PEXPIRE; gone → the lease lapsed
    {ns}:workers            the set of worker ids that may hold a lease (added at every
                            announce and heartbeat; routers remove ids whose lease is gone)
    {ns}:events             the event stream: XADD {"e": encoded batch}, MAXLEN ~ trimmed
    {ns}:gen                a random token created by whoever finds it missing: a different
                            token means Redis lost its data (restarted empty, flushed)
    {ns}:resync             a counter a router bumps at start (or after missing events) to ask
                            every worker to re-publish its full block set
"""

from __future__ import annotations

import asyncio
import re
import secrets
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis import exceptions as rex
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from kv_store.index.base import KVIndexConfigError
from kv_store.index.events import EventCodecError, WorkerRegistered, decode_batch

_NAMESPACE = re.compile(r"[A-Za-z0-9_.:\-]{1,100}")
_SCHEMES = ("redis", "rediss", "unix")

TRANSIENT = (rex.RedisError, OSError, asyncio.TimeoutError)
"""Errors a background loop survives: logged once per outage, retried with backoff."""


@dataclass(frozen=True)
class RedisIndexConfig:
    """Tuning of one `RedisKVIndex`; defaults suit a production cluster."""

    namespace: str = "pdserve:kv"
    """Prefix of every key, so several clusters (or tests) can share one Redis."""

    follow: bool = True
    """Tail the event stream into `prefix` and poll the registry (routers). Workers that only
    publish set False and save the traffic of every other worker's events."""

    stream_maxlen: int = 20_000
    """Approximate number of entries the event stream keeps (XADD MAXLEN ~). An entry carries
    up to `max_hashes_per_entry` hashes (so Redis memory stays under maxlen × 32 KiB, far less
    in practice); routers that fall further behind ask for a resync."""

    max_hashes_per_entry: int = 2048
    """Hashes per stream entry (~32 KiB); larger batches are split."""

    read_block_ms: int = 500
    """How long one XREAD waits for new entries (bounds how fast a stopped router notices)."""

    read_count: int = 512
    """Entries per XREAD."""

    registry_poll_s: float = 1.0
    """How often routers read the lease keys (worker liveness, new-generation check)."""

    retry_min_s: float = 0.05
    """First retry delay after an error; doubles on each failure up to `retry_max_s`."""

    retry_max_s: float = 2.0
    """Longest retry delay while Redis is unreachable."""

    socket_timeout_s: float = 5.0
    """Longest wait for one Redis reply (also connects); must exceed `read_block_ms`."""

    max_pending_hashes: int = 1_000_000
    """Worker-side backlog limit while Redis is away; beyond it queued block events are dropped
    and workers re-publish from their snapshot instead."""

    register_wait_s: float = 2.0
    """How long `register`/`unregister` wait for their first delivery before returning."""

    close_flush_s: float = 1.0
    """Best-effort flush of queued events in `close()`."""

    tls_ca: str = ""
    """PEM CA file that signed the server's certificate, for `rediss://` URLs ("" = the
    system's roots). The URL itself carries an ACL user and password:
    `rediss://user:password@host:port/db`."""

    def __post_init__(self) -> None:
        if not _NAMESPACE.fullmatch(self.namespace):
            raise ValueError(
                f"RedisIndexConfig.namespace must match [A-Za-z0-9_.:-]{{1,100}}, "
                f"got {self.namespace!r}")
        for name in ("stream_maxlen", "max_hashes_per_entry", "read_block_ms", "read_count",
                     "max_pending_hashes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"RedisIndexConfig.{name} must be a positive int")
        for name in ("registry_poll_s", "retry_min_s", "retry_max_s", "socket_timeout_s",
                     "register_wait_s", "close_flush_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RedisIndexConfig.{name} must be positive")
        if self.socket_timeout_s * 1000 <= self.read_block_ms:
            raise ValueError("RedisIndexConfig.socket_timeout_s must exceed read_block_ms")


class Keys:
    """Key names of one namespace."""

    def __init__(self, namespace: str) -> None:
        self.stream = f"{namespace}:events"
        self.gen = f"{namespace}:gen"
        self.resync = f"{namespace}:resync"
        self.workers = f"{namespace}:workers"
        self._lease = f"{namespace}:lease:"

    def lease(self, worker_id: str) -> str:
        return self._lease + worker_id


def masked_url(url: str) -> str:
    """`url` with its password replaced, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def check_url(url: str) -> str:
    """Validate the scheme of a Redis index URL (`KVIndexConfigError` otherwise)."""
    if not isinstance(url, str) or urlsplit(url).scheme not in _SCHEMES:
        shown = masked_url(url) if isinstance(url, str) else url
        raise KVIndexConfigError(
            f"index url must start with one of {[s + '://' for s in _SCHEMES]}, got {shown!r}")
    return url


def connect(url: str, config: RedisIndexConfig) -> aioredis.Redis:
    """A client for `url` (AUTH user/password taken from it; TLS for `rediss://`, verified
    against `config.tls_ca`) that never retries by itself: the index's loops own retrying,
    so a dead server is noticed at once."""
    tls = {}
    if urlsplit(url).scheme == "rediss":
        tls = {"ssl_cert_reqs": "required", **({"ssl_ca_certs": config.tls_ca}
                                               if config.tls_ca else {})}
    return aioredis.Redis.from_url(
        url, protocol=2, retry=Retry(NoBackoff(), 0),
        socket_timeout=config.socket_timeout_s, socket_connect_timeout=config.socket_timeout_s,
        **tls)


def config_error(exc: BaseException, url: str) -> KVIndexConfigError | None:
    """The startup error to raise for `exc`, when it means the configuration is wrong."""
    if isinstance(exc, rex.AuthenticationError | rex.AuthorizationError | rex.NoPermissionError):
        return KVIndexConfigError(
            f"Redis at {masked_url(url)} refused the credentials (check the password/username "
            f"in the index url): {exc}")
    if isinstance(exc, rex.ResponseError) and str(exc).startswith(("NOAUTH", "WRONGPASS")):
        return KVIndexConfigError(f"Redis at {masked_url(url)} refused the credentials: {exc}")
    if "CERTIFICATE_VERIFY_FAILED" in str(exc):  # not an outage: retrying cannot help
        return KVIndexConfigError(
            f"Redis at {masked_url(url)} presented a certificate that the configured CA "
            f"(--redis-ca / $PDSERVE_REDIS_CA) does not verify: {exc}")
    return None


async def ensure_gen(client: aioredis.Redis, keys: Keys) -> bytes:
    """The data generation token, created if missing (first process wins)."""
    async with client.pipeline(transaction=False) as pipe:
        pipe.set(keys.gen, secrets.token_hex(8).encode(), nx=True)
        pipe.get(keys.gen)
        _, gen = await pipe.execute()
    return gen


async def read_leases(client: aioredis.Redis, keys: Keys, prune: bool = False
                      ) -> dict[str, tuple[WorkerRegistered, float]]:
    """Every current lease: worker id → (its registration, seconds left). With `prune`, ids
    whose lease is gone leave the worker set (a live worker re-adds itself at its heartbeat)."""
    ids = sorted(m.decode() for m in await client.smembers(keys.workers))
    if not ids:
        return {}
    async with client.pipeline(transaction=False) as pipe:
        for worker_id in ids:
            pipe.get(keys.lease(worker_id))
            pipe.pttl(keys.lease(worker_id))
        replies = await pipe.execute()
    out: dict[str, tuple[WorkerRegistered, float]] = {}
    gone = []
    for i, worker_id in enumerate(ids):
        value, pttl = replies[2 * i], replies[2 * i + 1]
        reg = _registration(value)
        if reg is not None and pttl > 0 and reg.worker_id == worker_id:
            out[worker_id] = (reg, pttl / 1000)
        elif value is None:
            gone.append(worker_id)
    if prune and gone:
        await client.srem(keys.workers, *gone)
    return out


def _registration(value: Any) -> WorkerRegistered | None:
    if not isinstance(value, bytes):
        return None
    try:
        events = decode_batch(value)
    except EventCodecError:
        return None
    return events[0] if events and isinstance(events[0], WorkerRegistered) else None


def stream_id(raw: bytes | str) -> tuple[int, int]:
    ms, _, seq = (raw.decode() if isinstance(raw, bytes) else raw).partition("-")
    return int(ms), int(seq or 0)


def raise_if_cancelling() -> None:
    """Re-raise a cancellation that a client library turned into an ordinary error (or
    swallowed): a loop that catches `Exception` must still stop when its task is cancelled."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


class Backoff:
    """Exponential retry delay between `lo` and `hi` seconds."""

    def __init__(self, lo: float, hi: float) -> None:
        self._lo, self._hi, self._next = lo, hi, lo

    def next(self) -> float:
        delay, self._next = self._next, min(self._next * 2, self._hi)
        return delay

    def reset(self) -> None:
        self._next = self._lo
