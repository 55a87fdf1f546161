"""The decode worker's KV sink: writes only into reserved blocks, only while the request lives,
and activates a request only when every (layer, block) it needs has arrived."""

from __future__ import annotations

import pytest
import torch

from decode_worker.kv_sink import DecodeKVSink, copy_blocks
from pdserve.serving import kv_messages
from pdserve.serving.kv_lease import Lease
from pdserve.serving.kv_messages import PartsDone, PrefillDone, PullDone

LAYERS, BLOCKS, SHAPE = 2, 8, (2, 2, 4, 3)  # [2, KVH, bs, D] per block
TICKET = b"t" * 16


def make():
    caches = [torch.zeros(BLOCKS, *SHAPE) for _ in range(LAYERS)]
    ready, errors = [], []
    sink = DecodeKVSink(caches, lambda rid, done, lease: ready.append((rid, done)),
                        lambda rid, why: errors.append((rid, why)))
    return sink, caches, ready, errors


def lease(seconds=10.0):
    return Lease.start(seconds)


def first(token):
    return kv_messages.encode(PrefillDone(token))


def kv(n, value):
    return torch.full((n, *SHAPE), float(value))


def test_layers_land_in_reserved_blocks_and_done_activates():
    sink, caches, ready, errors = make()
    sink.expect("r", [5, 2, 7], skip=1, lease=lease(), ticket=TICKET)  # block 5: cached on D
    for layer in range(LAYERS):
        sink.on_layer("r", layer, [2, 7], kv(2, layer + 1))
    sink.on_done("r", first(9))
    assert ready == [("r", PrefillDone(9))] and errors == []
    assert torch.all(caches[1][2] == 2) and torch.all(caches[0][7] == 1)
    assert torch.all(caches[0][5] == 0)  # the skipped block is untouched


def test_done_before_the_last_layer_waits_and_missing_parts_expire_with_the_lease():
    sink, _, ready, errors = make()
    sink.expect("r", [1, 2], skip=0, lease=lease(), ticket=TICKET)
    sink.on_layer("r", 0, [1, 2], kv(2, 1))
    sink.on_done("r", first(9))  # another prefill rank may still be sending layer 1
    sink.on_done("r", kv_messages.encode(PartsDone()))  # that pair's share is not all
    sink.expire()
    assert ready == [] and errors == []
    sink.expect("r", [1, 2], skip=0, lease=Lease(0.0), ticket=TICKET)  # a lease that ran out
    sink.on_done("r", first(9))
    sink.expire()
    assert ready == [] and errors and "never arrived" in errors[0][1]


def test_head_slices_from_several_senders_complete_a_request():
    sink, caches, ready, errors = make()  # this rank holds KV heads 0..1
    sink.expect("r", [3], skip=0, lease=lease(), ticket=TICKET)
    sink.on_done("r", first(4))
    for layer in range(LAYERS):
        sink.on_layer("r", layer, [3], kv(1, 7)[:, :, :1], head_start=0)
        assert ready == []
        sink.on_layer("r", layer, [3], kv(1, 8)[:, :, 1:], head_start=1)
    assert ready == [("r", PrefillDone(4))] and errors == []
    assert torch.all(caches[0][3, :, 0] == 7) and torch.all(caches[0][3, :, 1] == 8)


def test_heads_of_another_rank_are_refused():
    sink, _, _, errors = make()
    sink.expect("r", [3], skip=0, lease=lease(), ticket=TICKET)
    sink.on_layer("r", 0, [3], kv(1, 7)[:, :, :1], head_start=2)
    assert errors


def test_writes_outside_the_reservation_fail_the_request():
    sink, caches, ready, errors = make()
    sink.expect("r", [1, 2], skip=0, lease=lease(), ticket=TICKET)
    sink.on_layer("r", 0, [3], kv(1, 5))
    assert errors and torch.all(caches[0][3] == 0)


def test_cancelled_request_never_writes_again():
    sink, caches, _, errors = make()
    sink.expect("r", [4], skip=0, lease=lease(), ticket=TICKET)
    assert sink.cancel("r")
    sink.on_layer("r", 0, [4], kv(1, 3))  # a late layer after the blocks were released
    sink.on_done("r", first(1))
    assert torch.all(caches[0][4] == 0) and errors == []


def test_expiry_fails_stalled_transfers():
    sink, _, _, errors = make()
    sink.expect("r", [4], skip=0, lease=Lease(0.0), ticket=TICKET)
    sink.expire()
    assert errors and "lease expired" in errors[0][1] and sink.num_pending == 0


def test_a_bad_or_foreign_done_fails_the_request():
    sink, _, ready, errors = make()
    sink.expect("r", [4], skip=0, lease=lease(), ticket=TICKET)
    sink.on_done("r", b"\x81\xa1v\x63")  # {"v": 99}
    assert ready == [] and "version" in errors[0][1]
    sink.expect("s", [4], skip=0, lease=lease(), ticket=TICKET)
    sink.on_done("s", kv_messages.encode(PullDone(1)))  # a pull's DONE ends no prefill
    assert ready == [] and errors[1][0] == "s"


def test_the_ticket_book_names_the_current_expectation_only():
    sink, _, _, _ = make()
    assert sink.ticket("r") is None  # never expected: no frame may land
    sink.expect("r", [4], skip=0, lease=lease(), ticket=TICKET)
    assert sink.ticket("r@tp1.0") == TICKET  # any TP pair's wire id of the request
    sink.cancel("r")
    assert sink.ticket("r") is None
    sink.expect("r", [4], skip=0, lease=lease(), ticket=b"u" * 16)  # a later reservation
    assert sink.ticket("r") == b"u" * 16
    with pytest.raises(ValueError, match="ticket"):
        sink.expect("s", [5], skip=0, lease=lease(), ticket=b"")


@pytest.mark.parametrize("ids", [[3, 4, 5, 6], [6, 1, 2, 0], [7, 5, 3, 1, 0, 2, 4, 6],
                                 list(range(8))[::-1]])
def test_copy_blocks_matches_indexed_assignment_for_runs_and_scattered_ids(ids):
    src = torch.randn(len(ids), *SHAPE)
    dst, want = torch.zeros(BLOCKS, *SHAPE), torch.zeros(BLOCKS, *SHAPE)
    want[ids] = src
    copy_blocks(dst, ids, src)
    assert torch.equal(dst, want)


def test_copy_blocks_converts_dtype_writes_head_slices_and_refuses_a_short_payload(monkeypatch):
    import decode_worker.kv_sink as kv_sink
    for runs in (16, 0):  # plain copies per run, and the index_copy_ fallback
        monkeypatch.setattr(kv_sink, "_MAX_RUNS", runs)
        dst = torch.zeros(BLOCKS, *SHAPE, dtype=torch.bfloat16)
        src = torch.randn(3, 2, 1, 4, 3)
        copy_blocks(dst[:, :, 1:2], [2, 3, 6], src)
        assert torch.equal(dst[[2, 3, 6], :, 1:2], src.to(torch.bfloat16))
        assert not dst[:, :, 0].any() and not dst[[0, 1, 4, 5, 7]].any()
    with pytest.raises(ValueError, match="2 blocks of KV for 3 block ids"):
        copy_blocks(dst, [1, 2, 3], torch.zeros(2, *SHAPE))

