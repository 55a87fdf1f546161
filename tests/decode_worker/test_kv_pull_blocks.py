"""Block accounting of a pull on the engine thread: what is pinned and allocated, what is
published when blocks landed, and that every block comes back whatever happened."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from decode_worker.kv_pull import KVPuller
from decode_worker.kv_sink import DecodeKVSink
from kv_store.block_pool import BlockPool
from pdserve.block_hash import chain_hashes
from pdserve.engine.kv_manager import KVCacheManager

BS, EXTRA = 4, b"x" * 16
PROMPT = list(range(10, 31))  # 21 tokens: 5 full blocks, at most 5 usable (one token left)


def setup(cached_blocks=0):
    pool = BlockPool(16, BS)
    kv = KVCacheManager(pool, EXTRA)
    if cached_blocks:  # our own prefix cache holds the first blocks of the prompt
        held = pool.allocate(cached_blocks)
        for i, (b, h) in enumerate(zip(held, chain_hashes(PROMPT, BS, EXTRA), strict=False)):
            pool.cache_block(b, h, PROMPT[i * BS:(i + 1) * BS])
        pool.free(list(reversed(held)))
    engine = SimpleNamespace(scheduler=SimpleNamespace(kv=kv), tp_driver=None)
    sink = DecodeKVSink([torch.zeros(16, 2, 1, BS, 2)], lambda *a: None, lambda *a: None)
    counts = {}
    puller = KVPuller(None, sink, lambda: [], lambda k, v: counts.__setitem__(k, v))
    return puller, engine, pool, sink


def reserve(puller, engine, source_blocks):
    return puller._reserve(engine, "r", PROMPT, source_blocks, 5.0, lambda *a: None,
                           lambda *a: None)


def test_reserve_pins_our_prefix_and_allocates_the_rest_up_to_the_source():
    puller, engine, pool, sink = setup(cached_blocks=2)
    res = reserve(puller, engine, source_blocks=9)
    assert res.start == 2 and len(res.fresh) == 3  # blocks 2..4; block 5 is not full
    assert pool.num_used == 5 and sink.num_pending == 1


def test_landed_blocks_are_published_and_every_block_is_released():
    puller, engine, pool, sink = setup(cached_blocks=1)
    res = reserve(puller, engine, source_blocks=4)
    puller._settle(engine, "r", 2)  # blocks 1 and 2 landed, block 3 did not
    assert pool.is_idle() and sink.num_pending == 0
    hits = engine.scheduler.kv.pin_leading(PROMPT, 0, 5)
    assert hits == [pool.lookup(h, PROMPT[i * BS:(i + 1) * BS])
                    for i, h in enumerate(chain_hashes(PROMPT, BS, EXTRA)[:3])]
    assert hits[1:] == res.fresh[:2]
    engine.scheduler.kv.unpin(hits)
    assert pool.is_idle()


def test_a_failed_pull_publishes_nothing_and_settling_twice_is_harmless():
    puller, engine, pool, _ = setup()
    reserve(puller, engine, source_blocks=5)
    puller._settle(engine, "r", 0)
    puller._settle(engine, "r", 3)  # a late settle finds no reservation
    assert pool.is_idle() and pool.num_cached == 0


def test_nothing_is_reserved_when_we_hold_as_much_as_the_source():
    puller, engine, pool, sink = setup(cached_blocks=3)
    assert reserve(puller, engine, source_blocks=3) is None
    assert pool.is_idle() and sink.num_pending == 0


def test_pin_leading_from_a_later_block_checks_hashes_and_tokens():
    _, engine, pool, _ = setup(cached_blocks=4)
    kv = engine.scheduler.kv
    run = kv.pin_leading(PROMPT, 2, 5)
    assert len(run) == 2 and pool.num_used == 2  # blocks 2, 3 (block 4 not held)
    kv.unpin(run)
    other = PROMPT[:8] + [0] * 13  # same first two blocks, different block 2
    assert kv.pin_leading(other, 2, 5) == []
    assert pool.is_idle()
