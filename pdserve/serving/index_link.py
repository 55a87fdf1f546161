"""A worker's link to the cluster KV index in Redis (`--redis URL`).

The link owns the worker's side of the index: its registration, lease heartbeats and the
delivery of its prefix-cache changes. It is the one consumer of the worker's `BlockRecorder`
(with a link, `GetStats` carries no KV events).

    open_index_link  connect before the model loads: wrong credentials end the process at once
         │           with a clear message (an unreachable Redis only degrades: the index retries)
         ▼
    attach           register under the gRPC address the router knows (host:port, as announced
         │           in PDSERVE_READY), then every `publish_period_s` publish `recorder.drain()`
         │           and every ttl/3 heartbeat (a lost lease re-registers with a snapshot)
         ▼
    close            last events, unregister, disconnect — best effort, bounded in time

The recorder's events carry the worker id it was built with (the engine needs the recorder
before the server's port is known); the link re-keys them to the address, the one name of a
worker across the cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kv_store.index import KVIndex, KVIndexConfigError, create_index
from kv_store.index.events import BlockRemoved, BlockStored, Event
from kv_store.index.recorder import BlockRecorder
from pdserve.serving.worker_options import WorkerOptions

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class IndexLinkConfig:
    """Timing of a worker's index link."""

    ttl_s: float = 10.0
    """Lease of the registration: routers drop a silent worker's blocks after this long."""

    publish_period_s: float = 0.05
    """How often the recorder's changes are handed to the index (which batches them)."""

    close_timeout_s: float = 3.0
    """Longest `close` may take (last events, unregister, disconnect)."""

    def __post_init__(self) -> None:
        for name in ("ttl_s", "publish_period_s", "close_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"IndexLinkConfig.{name} must be positive")

    @property
    def heartbeat_s(self) -> float:
        return self.ttl_s / 3


class IndexLink:
    """Registers one worker in a started `KVIndex` and keeps its entry current."""

    def __init__(self, index: KVIndex, recorder: BlockRecorder,
                 config: IndexLinkConfig | None = None) -> None:
        self.index = index
        self.recorder = recorder
        self.config = config or IndexLinkConfig()
        self.worker_id: str | None = None  # the address, once attached
        self._task: asyncio.Task[None] | None = None

    async def attach(self, address: str, info: Mapping[str, Any]) -> None:
        """Register as `address` (with the recorder's snapshot) and start the update loop."""
        if self.worker_id is not None:
            raise RuntimeError(f"index link already attached as {self.worker_id!r}")
        await self.index.register(address, info, self.config.ttl_s,
                                  snapshot=self.recorder.snapshot)
        self.worker_id = address
        self._task = asyncio.create_task(self._run(), name="kv-index-link")

    async def _run(self) -> None:
        next_beat = time.monotonic() + self.config.heartbeat_s
        while True:
            await asyncio.sleep(self.config.publish_period_s)
            try:
                await self._publish_pending()
                if time.monotonic() >= next_beat:
                    next_beat = time.monotonic() + self.config.heartbeat_s
                    await self.index.heartbeat(self.worker_id)
            except Exception:  # a bad batch must not end the worker's registration
                log.exception("KV index: publishing failed; continuing")

    async def _publish_pending(self) -> None:
        events = rekey(self.recorder.drain(), self.worker_id)
        if events:
            await self.index.publish(events)

    async def close(self) -> None:
        """Stop updating, unregister and disconnect, within `close_timeout_s`."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        try:
            await asyncio.wait_for(self._leave(), self.config.close_timeout_s)
        except TimeoutError:
            log.warning("KV index: leaving took over %.1fs; the lease will expire instead",
                        self.config.close_timeout_s)

    async def _leave(self) -> None:
        if self.worker_id is not None:
            await self._publish_pending()
            await self.index.unregister(self.worker_id)
        await self.index.close()


def rekey(events: Sequence[Event], worker_id: str) -> list[Event]:
    """The recorder's block events under `worker_id` (the name the cluster knows)."""
    out: list[Event] = []
    for e in events:
        if not isinstance(e, BlockStored | BlockRemoved):
            raise ValueError(f"a recorder yields block events only, got {type(e).__name__}")
        out.append(e if e.worker_id == worker_id else dataclasses.replace(e, worker_id=worker_id))
    return out


def worker_info(options: WorkerOptions, engine: Any, **extra: Any) -> dict[str, Any]:
    """What a worker's registration tells routers about it (msgpack-serialisable)."""
    return {"role": options.role, "worker_id": options.worker_id, "model_id": engine.model_id,
            "block_size": engine.config.block_size,
            "tp_size": engine.config.tensor_parallel_size,
            "max_model_len": engine.max_model_len, **extra}


async def open_index_link(options: WorkerOptions, recorder: BlockRecorder,
                          config: IndexLinkConfig | None = None) -> IndexLink | None:
    """A connected link for `options.redis_url` (None without one). Wrong credentials or a bad
    URL end the process here, with a message that names the URL without its password."""
    if not options.redis_url:
        return None
    from kv_store.index.redis_common import check_url, masked_url  # redis only when used

    try:
        index = create_index(check_url(options.redis_url), follow=False,
                             tls_ca=options.redis_ca)
        await index.start()
    except KVIndexConfigError as exc:
        raise SystemExit(f"{options.role} worker {options.worker_id}: --redis: {exc}") from None
    log.info("KV index: publishing to %s", masked_url(options.redis_url))
    return IndexLink(index, recorder, config)
