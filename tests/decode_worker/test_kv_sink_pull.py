"""The sink's pull mode: a DONE that says how many blocks were sent ends the wait for the
rest, and a pull's own callbacks replace the sink's."""

from __future__ import annotations

import torch

from decode_worker.kv_sink import DecodeKVSink
from pdserve.serving.kv_push import PULL_BLOCKS

LAYERS, BLOCKS, SHAPE = 2, 8, (2, 2, 4, 3)


def make(primary=True):
    caches = [torch.zeros(BLOCKS, *SHAPE) for _ in range(LAYERS)]
    default = []
    sink = DecodeKVSink(caches, lambda rid, meta: default.append(("ready", rid)),
                        lambda rid, why: default.append(("error", rid)), primary=primary)
    return sink, caches, default


def expect_pull(sink, blocks, timeout_s=10.0):
    seen = []
    sink.expect("r", blocks, 0, timeout_s, on_ready=lambda rid, meta: seen.append(meta),
                on_error=lambda rid, why: seen.append(why))
    return seen


def test_done_with_fewer_blocks_completes_once_those_arrived():
    sink, caches, default = make()
    seen = expect_pull(sink, [4, 5, 6])
    for layer in range(LAYERS):
        sink.on_layer("r", layer, [4, 5], torch.full((2, *SHAPE), 3.0))
    assert seen == []  # block 6 is still expected until the DONE says otherwise
    sink.on_done("r", {PULL_BLOCKS: 2})
    assert seen == [{PULL_BLOCKS: 2}] and default == []  # the pull's callback, not the sink's
    assert torch.all(caches[1][5] == 3) and torch.all(caches[0][6] == 0)
    assert sink.num_pending == 0


def test_done_before_its_layers_waits_for_them():
    sink, _, _ = make()
    seen = expect_pull(sink, [1, 2])
    sink.on_done("r", {PULL_BLOCKS: 1})
    sink.on_layer("r", 0, [1], torch.ones(1, *SHAPE))
    assert seen == []
    sink.on_layer("r", 1, [1], torch.ones(1, *SHAPE))
    assert seen == [{PULL_BLOCKS: 1}]


def test_follower_rank_completes_on_its_blocks_without_a_first_token():
    sink, _, _ = make(primary=False)
    seen = expect_pull(sink, [1, 2, 3])
    for layer in range(LAYERS):
        sink.on_layer("r", layer, [1], torch.ones(1, *SHAPE))
    sink.on_done("r", {PULL_BLOCKS: 1})
    assert seen == [{PULL_BLOCKS: 1}]


def test_a_bad_block_count_and_expiry_fail_the_pull_through_its_callback():
    sink, _, default = make()
    seen = expect_pull(sink, [1])
    sink.on_done("r", {PULL_BLOCKS: -1})
    assert len(seen) == 1 and PULL_BLOCKS in seen[0] and default == []
    seen = expect_pull(sink, [1], timeout_s=-1.0)
    sink.expire()
    assert seen == ["KV transfer timed out"] and default == []


def test_cancelled_pull_writes_nothing():
    sink, caches, _ = make()
    seen = expect_pull(sink, [2])
    assert sink.cancel("r")
    sink.on_layer("r", 0, [2], torch.ones(1, *SHAPE))
    sink.on_done("r", {PULL_BLOCKS: 1})
    assert seen == [] and torch.all(caches[0][2] == 0)
