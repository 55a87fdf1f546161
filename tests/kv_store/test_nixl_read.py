"""NIXL reads (wire v9): the OFFER, lent staging slots, and landing a `RemoteKV` in place.

The pieces are checked one by one here; `test_transfer.py` runs every NIXL pair over
loopback, where the sender offers its staging pool and the receiver reads (the default).
"""

from __future__ import annotations

import ctypes
import gc

import pytest
import torch

from kv_store.transfer import wire
from kv_store.transfer.nixl_agent import Registration, is_local_host
from kv_store.transfer.nixl_path import LandingPool, NixlReceive
from kv_store.transfer.nixl_read import LocalRegions, ReadSource, RemoteKV, byte_ranges
from kv_store.transfer.wire import Header, Kind, ProtocolError


class _Agent:
    """The agent calls a pool makes (one process: no NIXL needed)."""

    def register(self, tensor):
        return Registration(object(), "DRAM")

    def deregister(self, reg) -> None:
        pass

    def metadata(self) -> bytes:
        return b"agent-metadata"

    def connect(self, md: bytes) -> str:
        if md != b"agent-metadata":
            raise RuntimeError("unknown agent")
        self.users += 1
        return "peer"

    def disconnect(self, md: bytes) -> None:
        self.users -= 1

    users = 0  # pairs connected to the peer now


class CopyAgent(_Agent):
    """Does each read as a memory copy, and records it."""

    def __init__(self) -> None:
        self.reads: list[tuple] = []

    def read(self, peer, local_mem, local, remote_mem, remote, timeout_s) -> None:
        self.reads.append((local_mem, list(local), list(remote)))
        for (dst, n), (src, m) in zip(local, remote, strict=True):
            assert n == m
            ctypes.memmove(dst, src, n)


pytestmark = pytest.mark.unit


def test_an_offer_carries_a_descriptor_and_nothing_empty_or_oversized():
    h = wire.decode_header(wire.encode_header(Header(Kind.OFFER, body=b"descriptor")))
    assert (h.kind, h.body) == (Kind.OFFER, b"descriptor")
    with pytest.raises(ProtocolError, match="OFFER needs a descriptor"):
        wire.decode_header(wire.encode_header(Header(Kind.OFFER, body=b"")))
    big = wire.pack({"kind": "offer", "body": b"x" * (wire.MAX_OFFER_BYTES + 1)})
    with pytest.raises(ProtocolError, match="OFFER needs a descriptor"):
        wire.decode_header(big)


def test_byte_ranges_cover_a_view_in_row_major_order():
    cache = torch.zeros(6, 2, 4, 3, 5)
    assert byte_ranges(cache[1:3]) == [(cache[1].data_ptr(), 2 * cache[0].nbytes)]
    heads = cache[1:3, :, 1:3]  # a slice of heads: one range per block and K/V
    ranges = byte_ranges(heads)
    assert len(ranges) == 4 and all(n == 2 * 3 * 5 * 4 for _, n in ranges)
    assert ranges[0][0] == heads.data_ptr()
    assert byte_ranges(cache[:, :, :, :, ::2]) is None  # strided innermost: no ranges


def test_a_lent_slot_returns_when_its_last_view_is_gone():
    pool = LandingPool(_Agent(), 4 * 4096, 4096)
    lent = [pool.lend(4096) for _ in range(4)]
    assert pool.lend(1) is None and pool.num_free == 0
    view = lent[0].view(torch.float32).view(4, 256)
    assert pool.slot_of(view) == pool.slot_of(lent[0]) is not None
    del lent[0]
    gc.collect()
    assert pool.num_free == 0  # `view` still holds it
    del view
    gc.collect()
    assert pool.num_free == 1
    assert pool.lend(4097) is None  # larger than a slot
    assert pool.slot_of(torch.zeros(4)) is None


def test_a_pool_short_of_slots_asks_its_holders_first():
    pool = LandingPool(_Agent(), 4096, 4096)
    held = [pool.lend(4096)]

    class Holder:
        def let_go(self) -> None:
            held.clear()

    holder = Holder()
    pool.held_by(holder)
    gc.collect()
    assert pool.lend(4096) is not None


def _receiving_pair(regions: LocalRegions | None):
    agent = CopyAgent()
    pool = LandingPool(agent, 4 * 4096, 4096)
    staging = LandingPool(agent, 4 * 4096, 4096)
    rx = NixlReceive(pool, 2, fallback=None, regions=regions)
    rx.on_offer(Header(Kind.OFFER, body=staging.descriptor.encode()))
    return agent, rx, staging


def _layer(slot: int, n: int = 2) -> Header:
    return Header(Kind.LAYER, rid="r", layer=0, blocks=tuple(range(n)), shape=(n, 2, 2, 4, 8),
                  dtype="float32", slot=slot)


def test_a_remote_part_lands_in_registered_blocks_in_one_read():
    cache = torch.zeros(5, 2, 2, 4, 8)
    agent = CopyAgent()
    regions = LocalRegions(agent)
    regions.add(cache)
    _, rx, staging = _receiving_pair(regions)
    rx._source = ReadSource(agent, "peer", ("DRAM", 0), regions, 1.0)
    kv = torch.randn(2, 2, 2, 4, 8)
    lent = staging.lend(kv.nbytes)
    lent.view(torch.float32).copy_(kv.reshape(-1))
    part = rx.payload(None, _layer(staging.slot_of(lent)), 1.0)
    assert isinstance(part, RemoteKV) and part.nbytes == kv.nbytes
    part.read_runs(cache, [(3, 0, 2)])
    assert torch.equal(cache[3:5], kv) and not cache[:3].any()
    assert len(agent.reads) == 1 and agent.reads[0][0] == ("DRAM", 0)


def test_a_remote_part_for_unregistered_memory_goes_through_a_bounce_slot():
    agent, rx, staging = _receiving_pair(None)
    kv = torch.randn(2, 2, 2, 4, 8)
    lent = staging.lend(kv.nbytes)
    lent.view(torch.float32).copy_(kv.reshape(-1))
    part = rx.payload(None, _layer(staging.slot_of(lent)), 1.0)
    cache = torch.zeros(4, 2, 3, 4, 8)
    part.read_runs(cache[:, :, 1:], [(0, 0, 1), (2, 1, 1)])  # a head slice, two runs
    assert torch.equal(cache[0, :, 1:], kv[0]) and torch.equal(cache[2, :, 1:], kv[1])
    assert not cache[:, :, 0].any() and not cache[1].any()
    assert torch.equal(part.tensor(), kv)
    with pytest.raises(ValueError, match="cannot take KV"):
        part.read_runs(torch.zeros(4, 2, 1, 4, 8), [(0, 0, 2)])


def test_the_receiver_refuses_a_second_offer_and_parts_past_its_window():
    _, rx, staging = _receiving_pair(None)
    with pytest.raises(ProtocolError, match="second one"):
        rx.on_offer(Header(Kind.OFFER, body=staging.descriptor.encode()))
    rx.payload(None, _layer(0), 1.0)
    rx.payload(None, _layer(1), 1.0)
    with pytest.raises(ProtocolError, match="window"):
        rx.payload(None, _layer(2), 1.0)  # two granted slots: two parts unreleased at most
    rx.release(None, [_layer(0), _layer(1)], 1.0)
    rx.payload(None, _layer(2), 1.0)
    with pytest.raises(ProtocolError, match="staging slot 9"):
        rx.payload(None, _layer(9), 1.0)


def test_an_offer_without_granted_slots_or_of_a_foreign_agent_is_refused():
    agent = CopyAgent()
    staging = LandingPool(agent, 4096, 4096)
    empty = NixlReceive(None, 2, fallback=None)
    with pytest.raises(ProtocolError, match="granted no landing slots"):
        empty.on_offer(Header(Kind.OFFER, body=staging.descriptor.encode()))
    rx = NixlReceive(LandingPool(agent, 4096, 4096), 1, fallback=None)
    with pytest.raises(ProtocolError, match="not msgpack|version"):
        rx.on_offer(Header(Kind.OFFER, body=b"junk"))


def test_loopback_is_this_host_and_a_documentation_address_is_not():
    assert is_local_host("127.0.0.1") and is_local_host("localhost")
    assert not is_local_host("192.0.2.1")


def test_a_receiving_pair_lets_go_of_its_senders_agent_when_it_ends():
    agent, rx, _ = _receiving_pair(None)
    assert agent.users == 1  # the OFFER loaded the sender's agent
    rx.close(clean=False)
    rx.close(clean=False)
    assert agent.users == 0
