"""Where KV blocks arriving from prefill workers land in the decode worker's paged cache.

For each disaggregated request the sink knows the destination blocks it reserved and which
(layer, block) pairs it still expects. The transfer engine's threads call `on_layer` /
`on_done` / `on_failed`; the engine thread is told through the engine loop.

A lock orders writes against cancellation: `cancel()` takes it before the engine releases a
request's blocks, so a block can never be written after it was handed to another request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)


@dataclass
class PendingKV:
    block_ids: list[int]  # every prompt block of the request, in order
    skip: int  # leading blocks the decode worker already held
    deadline: float
    missing: set[tuple[int, int]] = field(default_factory=set)  # (layer, block index)
    bytes: int = 0


class DecodeKVSink:
    def __init__(self, caches: list[torch.Tensor],
                 on_ready: Callable[[str, dict], None],
                 on_error: Callable[[str, str], None]) -> None:
        self._caches = caches
        self._on_ready = on_ready
        self._on_error = on_error
        self._lock = threading.Lock()
        self._pending: dict[str, PendingKV] = {}
        self.bytes_received = 0

    def expect(self, request_id: str, block_ids: list[int], skip: int, timeout_s: float) -> None:
        missing = {(layer, i) for layer in range(len(self._caches))
                   for i in range(skip, len(block_ids))}
        with self._lock:
            self._pending[request_id] = PendingKV(list(block_ids), skip,
                                                  time.monotonic() + timeout_s, missing)

    def cancel(self, request_id: str) -> bool:
        """Stop accepting KV for a request (before its blocks are released)."""
        with self._lock:
            return self._pending.pop(request_id, None) is not None

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    # -- transfer-engine callbacks (receiver threads) -------------------------------------
    def on_layer(self, request_id: str, layer: int, block_ids: list[int],
                 kv: torch.Tensor) -> None:
        with self._lock:
            p = self._pending.get(request_id)
            if p is None:
                return  # cancelled or unknown: drop, never write
            allowed = {b: i for i, b in enumerate(p.block_ids) if i >= p.skip}
            if not 0 <= layer < len(self._caches) or any(b not in allowed for b in block_ids):
                self._fail_locked(request_id, "KV for blocks outside the reservation")
                return
            cache = self._caches[layer]
            index = torch.tensor(block_ids, dtype=torch.int64, device=cache.device)
            cache.index_copy_(0, index, kv.to(device=cache.device, dtype=cache.dtype))
            p.missing.difference_update((layer, allowed[b]) for b in block_ids)
            p.bytes += kv.numel() * kv.element_size()
            self.bytes_received += kv.numel() * kv.element_size()

    def on_done(self, request_id: str, meta: dict) -> None:
        with self._lock:
            p = self._pending.pop(request_id, None)
            if p is None:
                return
            if p.missing:
                self._on_error(request_id, f"transfer ended with {len(p.missing)} "
                                           "(layer, block) pairs missing")
                return
        self._on_ready(request_id, meta)

    def on_failed(self, request_id: str, reason: str) -> None:
        with self._lock:
            self._fail_locked(request_id, reason)

    def expire(self) -> None:
        """Fail requests whose KV did not arrive in time (called periodically)."""
        now = time.monotonic()
        with self._lock:
            for rid in [r for r, p in self._pending.items() if p.deadline < now]:
                self._fail_locked(rid, "KV transfer timed out")

    def _fail_locked(self, request_id: str, reason: str) -> None:
        if self._pending.pop(request_id, None) is not None:
            log.warning("KV for %s failed: %s", request_id, reason)
            self._on_error(request_id, reason)
