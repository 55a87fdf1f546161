"""The sink's pull mode: a DONE that says how many blocks were sent ends the wait for the
rest, and a pull's own callbacks replace the sink's."""

from __future__ import annotations

import torch

from decode_worker.kv_sink import DecodeKVSink
from pdserve.serving import kv_messages
from pdserve.serving.kv_lease import Lease
from pdserve.serving.kv_messages import PullDone

LAYERS, BLOCKS, SHAPE = 2, 8, (2, 2, 4, 3)


def make(primary=True):
    caches = [torch.zeros(BLOCKS, *SHAPE) for _ in range(LAYERS)]
    default = []
    sink = DecodeKVSink(caches, lambda rid, done, lease: default.append(("ready", rid)),
                        lambda rid, why: default.append(("error", rid)), primary=primary)
    return sink, caches, default


def expect_pull(sink, blocks, timeout_s=10.0):
    seen = []
    sink.expect("r", blocks, 0, Lease.start(timeout_s), b"t" * 16, PullDone,
                on_ready=lambda rid, done, lease: seen.append(done),
                on_error=lambda rid, why: seen.append(why))
    return seen


def pulled(n):
    return kv_messages.encode(PullDone(n))


def test_done_with_fewer_blocks_completes_once_those_arrived():
    sink, caches, default = make()
    seen = expect_pull(sink, [4, 5, 6])
    for layer in range(LAYERS):
        sink.on_layer("r", layer, [4, 5], torch.full((2, *SHAPE), 3.0))
    assert seen == []  # block 6 is still expected until the DONE says otherwise
    sink.on_done("r", pulled(2))
    assert seen == [PullDone(2)] and default == []  # the pull's callback, not the sink's
    assert torch.all(caches[1][5] == 3) and torch.all(caches[0][6] == 0)
    assert sink.num_pending == 0


def test_done_before_its_layers_waits_for_them():
    sink, _, _ = make()
    seen = expect_pull(sink, [1, 2])
    sink.on_done("r", pulled(1))
    sink.on_layer("r", 0, [1], torch.ones(1, *SHAPE))
    assert seen == []
    sink.on_layer("r", 1, [1], torch.ones(1, *SHAPE))
    assert seen == [PullDone(1)]


def test_follower_rank_completes_on_its_blocks_without_a_first_token():
    sink, _, _ = make(primary=False)
    seen = expect_pull(sink, [1, 2, 3])
    for layer in range(LAYERS):
        sink.on_layer("r", layer, [1], torch.ones(1, *SHAPE))
    sink.on_done("r", pulled(1))
    assert seen == [PullDone(1)]


def test_a_bad_block_count_and_expiry_fail_the_pull_through_its_callback():
    sink, _, default = make()
    seen = expect_pull(sink, [1])
    sink.on_done("r", b"\x83\xa1v\x01\xa4type\xa4pull\xa6blocks\xff")  # blocks = -1
    assert len(seen) == 1 and "blocks" in seen[0] and default == []
    seen = expect_pull(sink, [1], timeout_s=0.0)
    sink.expire()
    assert seen == ["KV lease expired before the transfer ended"] and default == []


def test_cancelled_pull_writes_nothing():
    sink, caches, _ = make()
    seen = expect_pull(sink, [2])
    assert sink.cancel("r")
    sink.on_layer("r", 0, [2], torch.ones(1, *SHAPE))
    sink.on_done("r", pulled(1))
    assert seen == [] and torch.all(caches[0][2] == 0)
