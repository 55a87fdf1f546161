"""Host tier: a capacity-bounded store of whole KV blocks in (pinned, on CUDA) CPU memory.

One slab of `num_slots x block_bytes` bytes is allocated up front (pinning many small tensors
is slow, one big one is cheap); a block — every layer of one paged block, as opaque bytes —
occupies one slot. Entries are keyed by block hash and keep their token ids, so a hit is
checked on content, not only on the hash. Least-recently-used entries are evicted when a new
block needs a slot; `on_evict` sees the evicted bytes first (to demote them to SSD).

Thread-safe: the engine thread demotes and loads, prefetch threads fill slots from SSD.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

EvictFn = Callable[[bytes, tuple[int, ...], torch.Tensor], None]
"""(hash, token ids, the slot's bytes — valid only during the call)."""


@dataclass
class _Entry:
    slot: int
    tokens: tuple[int, ...]


class HostStore:
    def __init__(self, capacity_bytes: int, block_bytes: int, pin: bool = False,
                 on_evict: EvictFn | None = None) -> None:
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        num_slots = int(capacity_bytes) // block_bytes
        if num_slots <= 0:
            raise ValueError(f"kv host capacity {capacity_bytes} B holds no block of "
                             f"{block_bytes} B")
        self.block_bytes = block_bytes
        self.num_slots = num_slots
        self._slab = torch.empty((num_slots, block_bytes), dtype=torch.uint8, pin_memory=pin)
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # LRU first
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._on_evict = on_evict
        self._lock = threading.RLock()
        self.num_evicted = 0

    # -- queries -------------------------------------------------------------------------
    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def bytes_used(self) -> int:
        return len(self) * self.block_bytes

    def has(self, block_hash: bytes, token_ids: Sequence[int]) -> bool:
        """Holds this block with exactly these tokens (no LRU touch)."""
        with self._lock:
            e = self._entries.get(block_hash)
            return e is not None and e.tokens == tuple(token_ids)

    def __contains__(self, block_hash: bytes) -> bool:
        with self._lock:
            return block_hash in self._entries

    def hashes(self) -> list[bytes]:
        with self._lock:
            return list(self._entries)

    def tokens_of(self, block_hash: bytes) -> tuple[int, ...] | None:
        with self._lock:
            e = self._entries.get(block_hash)
            return None if e is None else e.tokens

    # -- mutations -----------------------------------------------------------------------
    def touch(self, block_hash: bytes) -> None:
        """Mark a block most recently used (e.g. about to be loaded)."""
        with self._lock:
            if block_hash in self._entries:
                self._entries.move_to_end(block_hash)

    def put(self, block_hash: bytes, token_ids: Sequence[int], data: torch.Tensor) -> bool:
        """Copy `data` (block_bytes uint8) in; False if already held."""
        return self.put_with(block_hash, token_ids, lambda dst: dst.copy_(data.view(-1)))

    def put_with(self, block_hash: bytes, token_ids: Sequence[int],
                 fill: Callable[[torch.Tensor], object]) -> bool:
        """Take a slot (evicting the LRU entry if full) and let `fill(slot)` write the block.
        Returns False, changing nothing, if the block is already held (it becomes MRU)."""
        with self._lock:
            if block_hash in self._entries:
                self._entries.move_to_end(block_hash)
                return False
            slot = self._free_slots.pop() if self._free_slots else self._evict_lru()
            try:
                fill(self._slab[slot])
            except BaseException:
                self._free_slots.append(slot)
                raise
            self._entries[block_hash] = _Entry(slot, tuple(token_ids))
            return True

    def read(self, block_hash: bytes, token_ids: Sequence[int],
             use: Callable[[torch.Tensor], object]) -> bool:
        """If held with these tokens, call `use(slot bytes)` under the lock (so the slot is
        not reused meanwhile), mark it most recently used and return True."""
        with self._lock:
            e = self._entries.get(block_hash)
            if e is None or e.tokens != tuple(token_ids):
                return False
            self._entries.move_to_end(block_hash)
            use(self._slab[e.slot])
            return True

    def remove(self, block_hash: bytes) -> bool:
        with self._lock:
            e = self._entries.pop(block_hash, None)
            if e is None:
                return False
            self._free_slots.append(e.slot)
            return True

    def _evict_lru(self) -> int:
        h, e = self._entries.popitem(last=False)
        self.num_evicted += 1
        if self._on_evict is not None:
            self._on_evict(h, e.tokens, self._slab[e.slot])
        return e.slot
