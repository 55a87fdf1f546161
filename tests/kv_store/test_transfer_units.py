"""Transfer engine pieces that need no second process: wire codec, state machine, config,
argument validation."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
import torch

from kv_store.transfer import (
    KVSender,
    TransferConfig,
    TransferState,
    auth,
    carrier,
    coalesce,
    rendezvous,
    state,
    wire,
)
from kv_store.transfer.wire import Header, Kind, ProtocolError

ADDRESS = "127.0.0.1:1"


@pytest.mark.parametrize("header", [
    Header(Kind.LAYER, rid="r1", layer=3, blocks=(7, 0, 12), shape=(3, 2, 4, 16, 8),
           dtype="bfloat16", lease_s=2.5),
    Header(Kind.DONE, rid="r1", body=b"\x81\xa1v\x01", lease_s=0.25),
    Header(Kind.ABORT, rid="r1", reason="client went away"),
    Header(Kind.CLOSE, reason="idle"),
    Header(Kind.DONE, rid="r1", body=b"x", lease_s=1.0, tag=b"t" * 32),
])
def test_header_round_trips(header):
    assert wire.decode_header(wire.encode_header(header)) == header


def test_a_ticket_tag_covers_every_field_and_only_its_ticket_opens_it():
    ticket, other = auth.new_ticket(), auth.new_ticket()
    layer = auth.tagged(Header(Kind.LAYER, rid="r1", layer=3, blocks=(7, 0), shape=(2, 4),
                               dtype="uint8", head_start=2, lease_s=2.5), ticket)
    decoded = wire.decode_header(wire.encode_header(layer))
    assert auth.tag_matches(ticket, decoded)
    assert not auth.tag_matches(other, decoded)  # another transfer's ticket
    assert not auth.tag_matches(b"", decoded)
    for change in ({"rid": "r2"}, {"layer": 4}, {"blocks": (7, 1)}, {"head_start": 0},
                   {"shape": (2, 5)}, {"dtype": "float32"}, {"lease_s": 9.0}):
        assert not auth.tag_matches(ticket, dataclasses.replace(decoded, **change)), change
    done = auth.tagged(Header(Kind.DONE, rid="r1", body=b"first 7", lease_s=1.0), ticket)
    assert auth.tag_matches(ticket, done)
    assert not auth.tag_matches(ticket, dataclasses.replace(done, body=b"first 8"))
    assert not auth.tag_matches(ticket, dataclasses.replace(done, kind=Kind.ABORT))
    assert auth.tagged(done, b"") is done  # an unbound transfer: untagged
    with pytest.raises(ValueError, match="ticket"):
        auth.check_ticket(b"short")


def _layer(rid: str, layer: int, slot: int = -1) -> Header:
    return Header(Kind.LAYER, rid=rid, layer=layer, blocks=(layer, 9), shape=(2, 4),
                  dtype="uint8", lease_s=1.5, slot=slot, tag=b"t" * 32)


def test_a_batch_round_trips_its_parts_in_order_and_one_part_goes_alone():
    parts = (_layer("r1", 0, slot=3), _layer("r2", 0, slot=1), _layer("r1", 1))
    message = wire.batch(parts)
    assert message.kind is Kind.BATCH
    decoded = wire.decode_header(wire.encode_header(message))
    assert decoded == message and wire.layers_of(decoded) == parts
    alone = wire.batch(parts[:1])
    assert alone == parts[0] and wire.layers_of(alone) == parts[:1]
    with pytest.raises(ValueError, match="LAYER"):
        wire.batch((Header(Kind.DONE, rid="r1", body=b"", lease_s=1.0),))
    with pytest.raises(ValueError, match="at most"):
        wire.batch((parts[0],) * (wire.MAX_BATCH_PARTS + 1))


def _part_doc(**change) -> dict:
    return {**msgpack.unpackb(wire.encode_header(_layer("r", 0))), **change}


@pytest.mark.parametrize("parts", [
    [],  # empty
    [_part_doc()],  # a batch of one is sent as its LAYER
    [_part_doc()] * (wire.MAX_BATCH_PARTS + 1),
    [_part_doc(), {"kind": "done", "rid": "r", "body": b"", "lease_s": 1.0}],
    [_part_doc(), {"kind": "batch", "parts": [_part_doc(), _part_doc()]}],  # nested
    [_part_doc(), "layer"],
])
def test_malformed_batches_are_rejected(parts):
    with pytest.raises(ProtocolError, match="parts"):
        wire.decode_header(wire.pack({"kind": "batch", "parts": parts}))


def test_a_malformed_part_names_its_field():
    with pytest.raises(ProtocolError, match="slot"):
        wire.decode_header(wire.pack({"kind": "batch",
                                      "parts": [_part_doc(), _part_doc(slot=-2)]}))


def test_a_version_6_peer_is_refused():
    data = msgpack.packb({"v": 6, "kind": "close", "reason": ""})
    with pytest.raises(ProtocolError, match="version 6"):
        wire.decode_header(data)


@pytest.mark.parametrize("ready, cap, window, expected", [
    (0, 8, None, 0),   # nothing ready
    (1, 8, None, 1),   # a lone layer goes at once, alone
    (5, 8, None, 5),   # inline: everything ready, up to the cap
    (30, 8, None, 8),
    (30, 1, None, 1),  # cap 1: one part per message (the behaviour before wire v7)
    (30, 8, 8, 4),     # NIXL: half the window, so writing overlaps the receiver's copy
    (3, 8, 8, 3),
    (1, 8, 8, 1),      # a lone layer takes the first free slot
    (30, 8, 1, 1),     # a window of one slot still moves one part at a time
    (30, 8, 2, 1),
    (30, 2, 8, 2),
])
def test_coalescing_takes_what_is_ready_within_the_cap_and_half_the_window(
        ready, cap, window, expected):
    assert coalesce.parts_per_message(ready, cap, window) == expected


def test_every_header_carries_the_version():
    data = wire.encode_header(Header(Kind.CLOSE, reason="x"))
    assert msgpack.unpackb(data)["v"] == wire.VERSION


def test_foreign_version_is_rejected_naming_both_versions():
    data = msgpack.packb({"v": wire.VERSION + 1, "kind": "close", "reason": ""})
    with pytest.raises(ProtocolError, match=f"version {wire.VERSION + 1}.*speaks {wire.VERSION}"):
        wire.decode_header(data)


@pytest.mark.parametrize("doc, field", [
    ({"kind": "layer", "rid": "r", "layer": -1, "blocks": [1], "shape": [1], "dtype": "uint8",
      "lease_s": 1.0}, "layer"),
    ({"kind": "layer", "rid": "r", "layer": 0, "blocks": [1], "shape": [1], "dtype": "uint8"},
     "lease_s"),
    ({"kind": "layer", "rid": "r", "layer": 0, "blocks": [1, 2], "shape": [1, 4],
      "dtype": "uint8"}, "shape"),
    ({"kind": "layer", "rid": "r", "layer": 0, "blocks": [1], "shape": [1], "dtype": "int64"},
     "dtype"),
    ({"kind": "layer", "rid": "r", "layer": 0, "blocks": [-3], "shape": [1], "dtype": "uint8"},
     "blocks"),
    ({"kind": "layer", "rid": "r", "layer": 0, "blocks": [True], "shape": [1], "dtype": "uint8",
      "lease_s": 1.0}, "blocks"),
    ({"kind": "layer", "rid": "r", "layer": 0, "blocks": [1], "shape": [1.0], "dtype": "uint8",
      "lease_s": 1.0}, "shape"),
    ({"kind": "done", "rid": "r", "body": [1, 2], "lease_s": 1.0}, "body"),
    ({"kind": "done", "rid": "r", "body": b"", "lease_s": 1}, "lease_s"),
    ({"kind": "done", "rid": "r", "body": b"x" * (wire.MAX_BODY_BYTES + 1), "lease_s": 1.0},
     "body"),
    ({"kind": "abort", "rid": "", "reason": "x"}, "rid"),
    ({"kind": "abort", "rid": "r", "reason": "x", "tag": "t"}, "tag"),
    ({"kind": "abort", "rid": "r", "reason": "x", "tag": b"t" * (wire.MAX_TAG_BYTES + 1)},
     "tag"),
    ({"kind": "teleport", "rid": "r"}, "kind"),
])
def test_malformed_headers_are_rejected_naming_the_field(doc, field):
    with pytest.raises(ProtocolError, match=field):
        wire.decode_header(wire.pack(doc))


def test_garbage_is_a_protocol_error():
    with pytest.raises(ProtocolError):
        wire.decode_header(b"\xc1\xff\x00")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16,
                                   torch.float8_e4m3fn, torch.uint8])
def test_payload_carrier_preserves_bytes(dtype):
    kv = (torch.randn(3, 2, 2, 4, 8) * 8).to(dtype)
    name = carrier.dtype_name(dtype)
    moved = carrier.to_carrier(kv)
    assert moved.dtype in (torch.uint8, torch.float32, torch.bfloat16, torch.float16)
    back = carrier.from_carrier(moved.clone(), name)
    assert back.dtype == dtype and back.shape == kv.shape
    assert torch.equal(back.view(torch.uint8), kv.view(torch.uint8))
    assert wire.payload_nbytes(tuple(kv.shape), name) == kv.numel() * kv.element_size()


def test_unsupported_dtype_is_refused():
    with pytest.raises(ValueError, match="kv dtype"):
        carrier.dtype_name(torch.int64)


def test_state_machine_allows_only_the_drawn_edges():
    S = TransferState
    legal = {(S.PENDING, S.TRANSFERRING), (S.PENDING, S.FAILED), (S.TRANSFERRING, S.DONE),
             (S.TRANSFERRING, S.FAILED)}
    for old in S:
        for new in S:
            if (old, new) in legal:
                state.check_transition(old, new)
            else:
                with pytest.raises(ValueError, match="illegal"):
                    state.check_transition(old, new)
    assert {s for s in S if s.terminal} == {S.DONE, S.FAILED}


def test_history_forgets_the_oldest_first():
    history = state.History(2)
    history.add("a", TransferState.DONE)
    history.add("b", TransferState.FAILED, "why")
    history.add("c", TransferState.DONE)
    assert history.get("a") is None
    assert history.get("b") is TransferState.FAILED and history.reason("b") == "why"


@pytest.mark.parametrize("kwargs, field", [
    ({"backend": "mpi"}, "backend"),
    ({"lease_s": 0}, "lease_s"),
    ({"io_timeout_s": -1.0}, "io_timeout_s"),
    ({"max_pairs": 0}, "max_pairs"),
    ({"idle_timeout_s": "5"}, "idle_timeout_s"),
    ({"cuda_device": -1}, "cuda_device"),
    ({"coalesce_max_parts": 0}, "coalesce_max_parts"),
    ({"coalesce_max_parts": wire.MAX_BATCH_PARTS + 1}, "coalesce_max_parts"),
])
def test_config_rejects_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        TransferConfig(**kwargs)


@pytest.mark.parametrize("address", ["nohost", "host:", ":80", "host:0", "host:99999", 5])
def test_bad_addresses_are_refused(address):
    with pytest.raises(ValueError, match="address"):
        rendezvous.parse_address(address)


def test_ipv6_address_parses():
    assert rendezvous.parse_address("[::1]:7000") == ("::1", 7000)


@pytest.fixture
def sender():
    with KVSender(TransferConfig()) as s:
        yield s


@pytest.mark.parametrize("args, field", [
    ((ADDRESS, "", 0, [1], torch.zeros(1, 2)), "request_id"),
    ((ADDRESS, "r", -1, [1], torch.zeros(1, 2)), "layer"),
    ((ADDRESS, "r", 0, [1, 2], torch.zeros(1, 2)), "block_ids"),
    ((ADDRESS, "r", 0, [-1], torch.zeros(1, 2)), "block_ids"),
    ((ADDRESS, "r", 0, ["x"], torch.zeros(1, 2)), "block_ids"),
    ((ADDRESS, "r", 0, [1], torch.zeros(1, 2, dtype=torch.int32)), "dtype"),
    (("no-port", "r", 0, [1], torch.zeros(1, 2)), "address"),
])
def test_send_layer_validates_its_arguments(sender, args, field):
    with pytest.raises(ValueError, match=field):
        sender.send_layer(*args)
    with pytest.raises(KeyError):
        sender.state("r")  # nothing was recorded


def test_finish_requires_a_bytes_body_a_sane_lease_and_a_ticket_sized_ticket(sender):
    with pytest.raises(ValueError, match="body"):
        sender.finish(ADDRESS, "r", {"token_id": 1})
    with pytest.raises(ValueError, match="lease_s"):
        sender.finish(ADDRESS, "r", b"", lease_s=float("nan"))
    with pytest.raises(ValueError, match="ticket"):
        sender.finish(ADDRESS, "r", b"", ticket=b"not sixteen")


def test_closed_sender_refuses_work():
    s = KVSender(TransferConfig())
    s.close()
    with pytest.raises(RuntimeError, match="closed"):
        s.send_layer(ADDRESS, "r", 0, [1], torch.zeros(1, 2))


def test_layer_header_carries_the_head_offset_of_a_slice():
    from kv_store.transfer.wire import Header, Kind, decode_header, encode_header

    h = Header(Kind.LAYER, rid="r", layer=3, blocks=(4, 5), shape=(2, 2, 1, 16, 8),
               dtype="float32", head_start=2)
    assert decode_header(encode_header(h)).head_start == 2
