"""KV index events: wire codec (versioned msgpack), validation, batching, the block recorder."""

from __future__ import annotations

import msgpack
import pytest

from kv_store.block_pool import BlockPool
from kv_store.index import (
    VERSION,
    BlockRecorder,
    BlockRemoved,
    BlockStored,
    EventCodecError,
    Tier,
    WorkerGone,
    WorkerRegistered,
    decode_batch,
    encode_batch,
)
from kv_store.index.events import coalesce, pack_batches
from pdserve.block_hash import chain_hashes

H = chain_hashes(list(range(40)), 4)  # ten 16-byte block hashes


def test_every_event_kind_round_trips():
    events = [
        WorkerRegistered("decode-0", {"address": "127.0.0.1:9", "tp": 2}, ttl_s=7.5),
        BlockStored("decode-0", H[:3], Tier.HOST),
        BlockRemoved("decode-0", H[1:2], Tier.DEVICE),
        BlockRemoved("decode-0", H[2:3], None),
        WorkerGone("decode-0", "drained"),
    ]
    assert decode_batch(encode_batch(events)) == events


def test_a_batch_is_plain_versioned_msgpack():
    doc = msgpack.unpackb(encode_batch([BlockStored("w", H[:2])]), raw=False)
    assert doc["v"] == VERSION
    assert doc["events"] == [{"k": "stored", "w": "w", "h": H[0] + H[1], "t": "device"}]


def test_a_foreign_version_is_rejected():
    doc = msgpack.unpackb(encode_batch([WorkerGone("w")]), raw=False)
    doc["v"] = VERSION + 1
    with pytest.raises(EventCodecError, match="field 'v'.*unsupported event version"):
        decode_batch(msgpack.packb(doc))
    del doc["v"]
    with pytest.raises(EventCodecError, match="field 'v'"):
        decode_batch(msgpack.packb(doc))


@pytest.mark.parametrize("payload, field", [
    (b"\xc1garbage", "undecodable"),
    (msgpack.packb([1, 2]), "not a map"),
    (msgpack.packb({"v": VERSION, "events": 3}), "'events'"),
    (msgpack.packb({"v": VERSION, "events": [{"k": "moved", "w": "w"}]}), "'k'"),
    (msgpack.packb({"v": VERSION, "events": [{"k": "stored", "w": "w", "h": b"x" * 17,
                                              "t": "device"}]}), "'h'"),
    (msgpack.packb({"v": VERSION, "events": [{"k": "stored", "w": "w", "h": H[0],
                                              "t": "tape"}]}), "'t'"),
    (msgpack.packb({"v": VERSION, "events": [{"k": "stored", "w": "", "h": H[0],
                                              "t": "device"}]}), "worker_id"),
    (msgpack.packb({"v": VERSION, "events": [{"k": "registered", "w": "w", "info": {},
                                              "ttl": -1}]}), "ttl_s"),
])
def test_malformed_batches_are_rejected_naming_the_problem(payload, field):
    with pytest.raises(EventCodecError, match=field):
        decode_batch(payload)


def test_events_validate_their_fields():
    with pytest.raises(ValueError, match="worker_id"):
        BlockStored("has space", H[:1])
    with pytest.raises(ValueError, match="16-byte"):
        BlockStored("w", [b"short"])
    with pytest.raises(ValueError, match="ttl_s"):
        WorkerRegistered("w", {}, ttl_s=0)
    with pytest.raises(ValueError, match="info"):
        WorkerRegistered("w", {1: "x"})
    with pytest.raises(ValueError, match="msgpack"):
        encode_batch([WorkerRegistered("w", {"obj": object()})])


def test_coalesce_merges_runs_in_order_and_splits_big_ones():
    events = [BlockStored("a", [h]) for h in H[:5]] + [
        BlockRemoved("a", H[:1]), BlockStored("a", H[5:6]), BlockStored("b", H[6:7]),
        BlockStored("b", H[7:8], Tier.HOST), WorkerGone("c"), BlockStored("b", H[8:])]
    out = coalesce(events, max_hashes=3)
    assert out == [
        BlockStored("a", H[:3]), BlockStored("a", H[3:5]), BlockRemoved("a", H[:1]),
        BlockStored("a", H[5:6]), BlockStored("b", H[6:7]), BlockStored("b", H[7:8], Tier.HOST),
        WorkerGone("c"), BlockStored("b", H[8:]),
    ]


def test_pack_batches_bounds_each_message_and_keeps_the_sequence():
    many = chain_hashes(list(range(4 * 1000)), 4)
    events = [WorkerRegistered("a"), BlockStored("a", many), BlockRemoved("a", many[:10]),
              WorkerGone("a")]
    batches = pack_batches(events, max_hashes=256)
    decoded = [decode_batch(b) for b in batches]
    assert all(sum(len(getattr(e, "hashes", "x")) for e in batch) <= 256 for batch in decoded)
    assert [e for batch in decoded for e in batch] == coalesce(events, 256)


def test_recorder_turns_pool_events_into_batches_and_tracks_the_block_set():
    rec = BlockRecorder("w")
    pool = BlockPool(2, block_size=4, on_event=rec.on_block_event)
    a, b = pool.allocate(2)
    pool.cache_block(a, H[0], [0, 1, 2, 3])
    pool.cache_block(b, H[1], [4, 5, 6, 7])
    pool.free([b, a])
    assert rec.drain() == [BlockStored("w", H[:2], Tier.DEVICE)]
    assert rec.drain() == []
    (c,) = pool.allocate(1)  # evicts the LRU cached block (b, freed first)
    assert rec.drain() == [BlockRemoved("w", H[1:2], Tier.DEVICE)]
    rec.stored(H[5], Tier.SSD)
    assert rec.snapshot() == {Tier.DEVICE: [H[0]], Tier.SSD: [H[5]]}
    pool.free([c])
