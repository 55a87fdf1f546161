"""Block pool: reference counts, LRU reuse of cached free blocks, events, token-id checks."""

from __future__ import annotations

import pytest

from kv_store.block_pool import BlockPool


def test_allocate_and_free_return_to_idle():
    pool = BlockPool(4, block_size=2)
    blocks = pool.allocate(3)
    assert blocks is not None and len(set(blocks)) == 3
    assert pool.allocate(2) is None  # only one left; nothing taken on failure
    assert pool.num_free == 1
    pool.free(blocks)
    assert pool.is_idle()


def test_double_free_is_an_error():
    pool = BlockPool(2, block_size=2)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError):
        pool.free([b])


def test_cached_free_block_is_found_and_reused_without_eviction():
    events = []
    pool = BlockPool(3, block_size=2, on_event=events.append)
    (b,) = pool.allocate(1)
    pool.cache_block(b, b"h1", [5, 6])
    pool.free([b])
    assert pool.lookup(b"h1", [5, 6]) == b
    assert pool.lookup(b"h1", [5, 7]) is None  # same hash, other tokens: never a hit
    pool.take(b)
    assert pool.ref_count(b) == 1 and pool.num_free == 2
    pool.free([b])
    assert [e.kind for e in events] == ["stored"]


def test_lru_evicts_oldest_cached_block_and_prefers_uncached():
    events = []
    pool = BlockPool(3, block_size=1, on_event=events.append)
    a, b, c = pool.allocate(3)
    pool.cache_block(a, b"a", [1])
    pool.cache_block(b, b"b", [2])
    pool.free([a])
    pool.free([b])
    pool.free([c])  # uncached: handed out first
    assert pool.allocate(1) == [c]
    assert pool.allocate(1) == [a]  # least recently freed cached block is evicted next
    assert pool.lookup(b"a", [1]) is None and pool.lookup(b"b", [2]) == b
    assert [(e.kind, e.block_hash) for e in events][-1] == ("removed", b"a")


def test_shared_block_stays_until_last_reference():
    pool = BlockPool(2, block_size=1)
    (b,) = pool.allocate(1)
    pool.cache_block(b, b"x", [9])
    pool.take(b)
    pool.free([b])
    assert pool.ref_count(b) == 1 and pool.num_free == 1
    pool.free([b])
    assert pool.is_idle()


def test_caching_disabled_publishes_nothing():
    pool = BlockPool(2, block_size=1, enable_caching=False)
    (b,) = pool.allocate(1)
    pool.cache_block(b, b"x", [9])
    assert pool.lookup(b"x", [9]) is None
    pool.free([b])
