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


def test_eviction_candidates_follow_allocate_order_and_skip_uncached():
    pool = BlockPool(5, block_size=1)
    a, b, c, d = pool.allocate(4)
    for blk, h in ((a, b"a"), (b, b"b"), (c, b"c")):
        pool.cache_block(blk, h, [blk])
    pool.free([c, a, d, b])  # d is uncached: handed out first, never a candidate
    cands = pool.eviction_candidates(10)
    assert [(x.block_id, x.block_hash, x.token_ids) for x in cands] == [
        (c, b"c", (c,)), (a, b"a", (a,)), (b, b"b", (b,))]
    assert [x.block_id for x in pool.eviction_candidates(2)] == [c, a]
    assert pool.eviction_candidates(0) == []
    assert pool.num_free == 5 and pool.lookup(b"c", [c]) == c  # a pure read
    pool.take(a)  # a prefix hit takes a candidate back
    assert [x.block_id for x in pool.eviction_candidates(10)] == [c, b]
    got = pool.allocate(3)  # the two uncached blocks first, then the first candidate
    assert got is not None and set(got[:2]) == {d, 4} and got[2] == c


def test_reset_cache_and_caching_a_free_block_keep_the_candidates_right():
    evicted = []
    pool = BlockPool(3, block_size=1)
    pool.set_evict_listener(lambda blk, h, t: evicted.append(h))
    x, y = pool.allocate(2)
    pool.cache_block(x, b"x", [1])
    pool.free([x, y])
    pool.cache_block(y, b"y", [2])  # cached while free: joins the candidates' tail
    assert [c.block_hash for c in pool.eviction_candidates(5)] == [b"x", b"y"]
    pool.reset_cache()
    assert pool.eviction_candidates(5) == [] and pool.num_cached == 0
    assert pool.allocate(3) is not None and evicted == []  # nothing cached left to demote
