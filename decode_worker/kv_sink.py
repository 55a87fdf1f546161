"""Where KV blocks arriving from prefill workers land in the decode worker's paged cache.

For each disaggregated request the sink knows the destination blocks it reserved and which
(layer, block, KV head) triples of *this rank's heads* it still expects: with tensor
parallelism on either side, one rank's heads may arrive in slices from several prefill ranks
(re-sharding in transit). The transfer engine's threads call `on_layer` / `on_done` /
`on_failed`. A request is ready when nothing is missing and, on the primary rank, when the
prefill worker's DONE (carrying the first token) has arrived — in whichever order.

A pull (this worker copying a prefix another worker holds, `decode_worker.kv_pull`) uses the
same path with its own callbacks; its DONE carries `PULL_BLOCKS` (how many leading blocks of
the expectation were sent), and parts of the blocks beyond that count are no longer expected.

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

from kv_store.tp_layout import base_request_id
from pdserve.serving.kv_push import PULL_BLOCKS  # a pull's DONE: blocks sent after `skip`

log = logging.getLogger(__name__)
ReadyFn = Callable[[str, dict], None]
ErrorFn = Callable[[str, str], None]


@dataclass
class PendingKV:
    block_ids: list[int]  # every prompt block of the request, in order
    skip: int  # leading blocks the decode worker already held
    deadline: float
    missing: set[tuple[int, int, int]] = field(default_factory=set)  # (layer, index, head)
    meta: dict | None = None  # the prefill worker's DONE payload (first token)
    on_ready: ReadyFn | None = None  # this expectation's own callbacks (None: the sink's)
    on_error: ErrorFn | None = None


class DecodeKVSink:
    def __init__(self, caches: list[torch.Tensor],
                 on_ready: Callable[[str, dict], None],
                 on_error: Callable[[str, str], None],
                 head_start: int = 0, primary: bool = True) -> None:
        self._caches = caches
        self._on_ready = on_ready
        self._on_error = on_error
        self._head_start = head_start  # global index of this rank's first KV head
        self._num_heads = caches[0].shape[2] if caches else 0
        self._primary = primary  # the rank that receives DONE{first token}
        self._lock = threading.Lock()
        self._pending: dict[str, PendingKV] = {}
        self.bytes_received = 0

    def expect(self, request_id: str, block_ids: list[int], skip: int, timeout_s: float,
               on_ready: ReadyFn | None = None, on_error: ErrorFn | None = None) -> None:
        """Accept KV for blocks `block_ids[skip:]`; `on_ready` / `on_error` replace the
        sink's callbacks for this request only (they are called under the sink's lock, so
        they must only hand the news on)."""
        heads = range(self._head_start, self._head_start + self._num_heads)
        missing = {(layer, i, h) for layer in range(len(self._caches))
                   for i in range(skip, len(block_ids)) for h in heads}
        with self._lock:
            self._pending[request_id] = PendingKV(list(block_ids), skip,
                                                  time.monotonic() + timeout_s, missing,
                                                  on_ready=on_ready, on_error=on_error)

    def cancel(self, request_id: str) -> bool:
        """Stop accepting KV for a request (before its blocks are released)."""
        with self._lock:
            return self._pending.pop(request_id, None) is not None

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    # -- transfer-engine callbacks (receiver threads) -------------------------------------
    def on_layer(self, request_id: str, layer: int, block_ids: list[int],
                 kv: torch.Tensor, head_start: int = 0) -> None:
        """`kv` is [n, 2, heads, block_size, ...] for KV heads head_start.. (global index)."""
        request_id = base_request_id(request_id)
        with self._lock:
            p = self._pending.get(request_id)
            if p is None:
                return  # cancelled or unknown: drop, never write
            allowed = {b: i for i, b in enumerate(p.block_ids) if i >= p.skip}
            lo = head_start - self._head_start
            hi = lo + kv.shape[2]
            if (not 0 <= layer < len(self._caches) or lo < 0 or hi > self._num_heads
                    or any(b not in allowed for b in block_ids)):
                self._fail_locked(request_id, "KV outside the reservation or this rank's heads")
                return
            cache = self._caches[layer]
            index = torch.tensor(block_ids, dtype=torch.int64, device=cache.device)
            data = kv.to(device=cache.device, dtype=cache.dtype)
            if lo == 0 and hi == self._num_heads:
                cache.index_copy_(0, index, data)
            else:
                cache[:, :, lo:hi].index_copy_(0, index, data)
            p.missing.difference_update((layer, allowed[b], h) for b in block_ids
                                        for h in range(head_start, head_start + kv.shape[2]))
            self.bytes_received += kv.numel() * kv.element_size()
            self._complete_locked(request_id, p)

    def on_done(self, request_id: str, meta: dict) -> None:
        """A prefill rank finished sending; the primary's DONE carries the first token. A
        pull's DONE (every rank) carries the number of blocks sent: the rest will not come."""
        request_id = base_request_id(request_id)
        with self._lock:
            p = self._pending.get(request_id)
            if p is None:
                return
            if PULL_BLOCKS in meta:
                sent = meta[PULL_BLOCKS]
                if not isinstance(sent, int) or sent < 0:
                    self._fail_locked(request_id, f"bad {PULL_BLOCKS} in DONE: {sent!r}")
                    return
                end = p.skip + sent
                p.missing = {part for part in p.missing if part[1] < end}
                p.meta = meta
            elif "token_id" in meta:
                p.meta = meta
            self._complete_locked(request_id, p)

    def on_failed(self, request_id: str, reason: str) -> None:
        request_id = base_request_id(request_id)
        with self._lock:
            self._fail_locked(request_id, reason)

    def expire(self) -> None:
        """Fail requests whose KV did not arrive in time (called periodically)."""
        now = time.monotonic()
        with self._lock:
            for rid in [r for r, p in self._pending.items() if p.deadline < now]:
                p = self._pending[rid]
                why = (f"{len(p.missing)} (layer, block, head) parts never arrived"
                       if p.meta is not None else "KV transfer timed out")
                self._fail_locked(rid, why)

    def _complete_locked(self, request_id: str, p: PendingKV) -> None:
        if p.missing or (self._primary and p.meta is None):
            return
        del self._pending[request_id]
        (p.on_ready or self._on_ready)(request_id, p.meta or {})

    def _fail_locked(self, request_id: str, reason: str) -> None:
        p = self._pending.pop(request_id, None)
        if p is not None:
            log.warning("KV for %s failed: %s", request_id, reason)
            (p.on_error or self._on_error)(request_id, reason)
