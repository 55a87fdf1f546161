"""The block pool: owner of every paged-KV block of one cache.

A block is free (ref 0) or in use (ref > 0). A full block may also carry a content hash, which
makes it findable by later requests with the same prefix (prefix caching). Free blocks sit in
one LRU free list; a free block that still has a hash is "cached-free": reusable by a prefix hit
at no cost, or evicted (its hash dropped) when the list hands it out for new data.

    allocate ─► in use ─(free, ref→0)─► free list tail ─(allocate pops head)─► evicted, reused
                  ▲                            │
                  └──────(prefix hit)──────────┘

The free list is two OrderedDicts used as linked lists, read as one: uncached free blocks
(handed out first: they hold nothing reusable) followed by cached-free blocks in LRU order.
O(1) pop of the head, O(1) removal of a cached block taken back by a hit, O(1) append, and
`eviction_candidates(n)` reads the next n cached blocks to be evicted in O(n) (the tier
manager copies them to host memory ahead of time). Callers free a request's blocks tail first,
so the deepest blocks of a prefix are evicted before its shared root.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import islice


@dataclass(frozen=True)
class CachedBlock:
    """A cached-free block as seen by `eviction_candidates`: still on the device, reusable."""

    block_id: int
    block_hash: bytes
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class BlockEvent:
    """A change visible to the KV index: a block hash became (un)available in this pool."""

    kind: str  # "stored" | "removed"
    block_hash: bytes


class BlockPool:
    """Reference-counted blocks with a hash map for prefix reuse. Not thread-safe."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        on_event: Callable[[BlockEvent], None] | None = None,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._on_event = on_event
        self._ref = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self._by_hash: dict[bytes, int] = {}
        # The free list, head first: every uncached free block, then the cached-free ones.
        self._free_new: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # LRU first
        # Sees a cached block's id, hash and tokens just before `allocate` reuses it, while
        # its KV is still intact (the tier manager copies it to host memory there).
        self._on_evict: Callable[[int, bytes, tuple[int, ...]], None] | None = None

    def set_evict_listener(self, fn: Callable[[int, bytes, tuple[int, ...]], None]) -> None:
        """Call `fn(block_id, hash, token_ids)` before a cached free block is reused."""
        self._on_evict = fn

    # -- queries (pure) ------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (cached-free blocks included)."""
        return len(self._free_new) + len(self._free_cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks that carry a reusable hash (in use or free)."""
        return len(self._by_hash)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def is_idle(self) -> bool:
        return self.num_free == self.num_blocks and not any(self._ref)

    def lookup(self, block_hash: bytes, token_ids: Sequence[int]) -> int | None:
        """The block holding exactly these tokens under this hash, without taking it."""
        block = self._by_hash.get(block_hash)
        if block is None or self._tokens[block] != tuple(token_ids):
            return None
        return block

    def eviction_candidates(self, n: int) -> list[CachedBlock]:
        """The next `n` (or fewer) cached-free blocks in the order `allocate` would evict them.
        A pure read in O(n): uncached free blocks, which go first, are skipped for free."""
        out = []
        for block in islice(self._free_cached, max(0, n)):
            h, tokens = self._hash[block], self._tokens[block]
            assert h is not None and tokens is not None
            out.append(CachedBlock(block, h, tokens))
        return out

    # -- mutations -----------------------------------------------------------------------
    def allocate(self, n: int) -> list[int] | None:
        """Take `n` blocks (ref 1 each), evicting LRU cached-free ones; None if too few."""
        if n > self.num_free:
            return None
        blocks = []
        for _ in range(n):
            if self._free_new:
                block, _ = self._free_new.popitem(last=False)
            else:
                block, _ = self._free_cached.popitem(last=False)
                self._evict(block, demote=True)
            self._ref[block] = 1
            blocks.append(block)
        return blocks

    def take(self, block_id: int) -> None:
        """Add a reference to a block found by `lookup` (prefix hit)."""
        if self._ref[block_id] == 0:
            self._free_cached.pop(block_id, None)
            self._free_new.pop(block_id, None)
        self._ref[block_id] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the free list in order."""
        for block in block_ids:
            ref = self._ref[block]
            if ref <= 0:
                raise RuntimeError(f"double free of block {block}")
            self._ref[block] = ref - 1
            if ref == 1:
                if self._hash[block] is None:
                    # Uncached blocks hold nothing reusable: hand them out first.
                    self._free_new[block] = None
                    self._free_new.move_to_end(block, last=False)
                else:
                    self._free_cached[block] = None

    def cache_block(self, block_id: int, block_hash: bytes, token_ids: Sequence[int]) -> None:
        """Publish a full, computed block under its content hash (first writer wins)."""
        if not self.enable_caching or self._hash[block_id] is not None:
            return
        if len(token_ids) != self.block_size:
            raise ValueError("only full blocks can be cached")
        if block_hash in self._by_hash:
            return  # another block already holds this content; keep one copy findable
        self._hash[block_id] = block_hash
        self._tokens[block_id] = tuple(token_ids)
        self._by_hash[block_hash] = block_id
        if block_id in self._free_new:  # cached while free: it becomes an eviction candidate
            del self._free_new[block_id]
            self._free_cached[block_id] = None
        if self._on_event:
            self._on_event(BlockEvent("stored", block_hash))

    def reset_cache(self) -> None:
        """Forget every cached hash of free blocks (e.g. after weights change)."""
        for block in list(self._free_cached):
            self._evict(block)
            del self._free_cached[block]
            self._free_new[block] = None

    def _evict(self, block: int, demote: bool = False) -> None:
        h = self._hash[block]
        if h is None:
            return
        if demote and self._on_evict is not None:
            tokens = self._tokens[block]
            assert tokens is not None
            self._on_evict(block, h, tokens)
        self._hash[block] = None
        self._tokens[block] = None
        del self._by_hash[h]
        if self._on_event:
            self._on_event(BlockEvent("removed", h))
