"""The NIXL path's slot ring and credit counter (wire v8), in one process: a stand-in agent
moves bytes with memmove where NIXL would use CMA, the rest is the real `NixlSend`,
`NixlReceive` and `LandingPool`."""

from __future__ import annotations

import ctypes
import threading

import pytest
import torch

from kv_store.transfer import wire
from kv_store.transfer.channel import FORWARD_TAG, ChannelClosed
from kv_store.transfer.nixl_agent import NixlWriteError, Registration
from kv_store.transfer.nixl_path import LandingPool, NixlReceive, NixlSend
from kv_store.transfer.sender_pair import Outgoing
from kv_store.transfer.wire import Header, Kind, ProtocolError
from tests.helpers.cluster import eventually

SLOT = 4096


class MemmoveAgent:
    """What `NixlSend` / `LandingPool` need of a `NixlAgent`, within one process."""

    def register(self, tensor):
        return Registration(None, "DRAM")

    def deregister(self, reg):
        pass

    def metadata(self):
        return b"agent"

    def connect(self, metadata):
        self.users += 1
        return "peer"

    def disconnect(self, metadata):
        self.users -= 1

    def write(self, peer, mem, device, local, remote, timeout_s):
        for (src, n), (dst, m) in zip(local, remote, strict=True):
            assert n == m
            ctypes.memmove(dst, src, n)

    def reader(self, peer, local, remote, remote_mem="DRAM", remote_device=0):
        agent = self

        class Read:
            def read(self, timeout_s):
                agent.reads += 1
                if agent.gone:
                    raise NixlWriteError("remote agent was disconnected")
                ctypes.memmove(local[0], remote[0], local[1])

            def release(self):
                pass

        return Read()

    reads = 0
    users = 0  # pairs connected to the peer now
    gone = False  # the peer's agent died: every read fails


class Wire:
    """Both ends' frames: what the sender posts forward, what the receiver sends back."""

    def __init__(self):
        self.forward: list[Header] = []
        self.backward: list[Header] = []
        self.cv = threading.Condition()

    def post(self, tag, header, timeout_s):
        with self.cv:
            (self.forward if tag == FORWARD_TAG else self.backward).append(header)
            self.cv.notify_all()

    def send(self, tag, header, payload, timeout_s):
        assert payload is None
        self.post(tag, header, timeout_s)
        return 0

    def wait_forward(self, n, timeout=10.0):
        with self.cv:
            assert self.cv.wait_for(lambda: len(self.forward) >= n, timeout)
            return self.forward[n - 1]


def pair(slots, pool_slots=8):
    agent = MemmoveAgent()
    pool = LandingPool(agent, pool_slots * SLOT, SLOT, quarantine_s=0.01)
    rx = NixlReceive(pool, slots, fallback=None)
    tx = NixlSend(agent, pool.descriptor, fallback=None, cap=8)
    line = Wire()
    rx.start(line, 1.0)
    (grant,) = line.backward
    tx.on_grant(wire.decode_header(wire.encode_header(grant)))
    return agent, pool, rx, tx, line, grant


def layers(n, value0=0):
    """n one-block fp32 layers of one slot each, layer i filled with value0 + i."""
    return [Outgoing(Header(Kind.LAYER, rid="r", layer=i, blocks=(i,), shape=(1, SLOT // 4),
                            dtype="float32", lease_s=5.0),
                     torch.full((1, SLOT // 4), float(value0 + i)))
            for i in range(n)]


def receive(rx, line, message):
    """The receiver's part for one message: each part's bytes, then the release."""
    parts = wire.layers_of(message)
    got = [rx.payload(line, p, 1.0)[0, 0].item() for p in parts]
    rx.release(line, parts, 1.0)
    return got


def test_the_grant_names_the_slots_in_ring_order_and_a_credit_line_of_the_pool():
    _, pool, rx, _, _, grant = pair(4)
    assert grant.slots == (0, 1, 2, 3)
    pool.descriptor.check_credit(grant.credit)
    assert wire.decode_header(wire.encode_header(grant)) == grant
    for bad in ({"slots": [0, 1], "credit": -1}, {"slots": [], "credit": 64}):
        with pytest.raises(ProtocolError, match="credit"):
            wire.decode_header(wire.pack({"kind": "grant", **bad}))


def test_the_sender_writes_the_ring_in_order_and_waits_for_the_counter_not_a_message():
    agent, _, rx, tx, line, _ = pair(2)  # a window of 2: one part per message
    sent = threading.Thread(target=tx.send_layers, args=(line, layers(5), 5.0))
    sent.start()
    first, second = line.wait_forward(1), line.wait_forward(2)
    assert (first.slot, second.slot) == (0, 1)
    with line.cv:  # nothing more can go until the receiver counts a slot copied out
        assert not line.cv.wait_for(lambda: len(line.forward) > 2, 0.2)
    assert agent.reads >= 1 and tx.slot_waits >= 1
    got = receive(rx, line, first) + receive(rx, line, second)
    got += receive(rx, line, line.wait_forward(3)) + receive(rx, line, line.wait_forward(4))
    got += receive(rx, line, line.wait_forward(5))
    sent.join(5)
    assert got == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert [h.slot for h in line.forward] == [0, 1, 0, 1, 0]
    assert len(line.backward) == 1  # the one GRANT, no message per release


def test_the_receiver_refuses_a_part_that_names_another_slot_than_the_next():
    _, _, rx, tx, line, _ = pair(4)
    tx.send_layers(line, layers(2), 1.0)  # one BATCH: slots 0 and 1
    first, second = wire.layers_of(line.forward[0])
    with pytest.raises(ProtocolError, match="not the next one"):
        rx.payload(line, second, 1.0)  # skips the first
    assert rx.payload(line, first, 1.0)[0, 0].item() == 0.0


def test_a_second_grant_or_a_counter_that_goes_wrong_breaks_the_pair():
    _, pool, rx, tx, line, grant = pair(2)
    with pytest.raises(ProtocolError, match="second GRANT"):
        tx.on_grant(grant)
    tx.send_layers(line, layers(2), 1.0)  # both slots written, none released
    counter, _ = pool.credit(grant.slots[0])
    counter[1], counter[0] = ~5, 5  # says more released than was ever written
    with pytest.raises(ProtocolError, match="credit counter says 5"):
        tx.send_layers(line, layers(1), 1.0)


def test_a_torn_counter_is_read_again_and_a_closed_pair_stops_waiting():
    _, pool, rx, tx, line, grant = pair(2)
    tx.send_layers(line, layers(2), 1.0)
    counter, _ = pool.credit(grant.slots[0])
    counter[0] = 2  # the count of a newer update, the complement of the older one
    result = []
    waiter = threading.Thread(target=lambda: result.append(_raises(
        lambda: tx.send_layers(line, layers(1), 5.0))))
    waiter.start()
    with line.cv:
        assert not line.cv.wait_for(lambda: len(line.forward) > 2, 0.2)  # not trusted
    tx.close()
    waiter.join(5)
    assert isinstance(result[0], ChannelClosed)


def test_a_new_pair_on_a_credit_line_starts_from_zero():
    agent, pool, rx, tx, line, grant = pair(2, pool_slots=2)
    tx.send_layers(line, layers(2), 1.0)
    for message in line.forward:
        receive(rx, line, message)
    counter, _ = pool.credit(grant.slots[0])
    assert counter.tolist() == [2, ~2]
    rx.close(clean=True)
    again = NixlReceive(pool, 2, fallback=None)
    assert again.num_slots == 2 and counter.tolist() == [0, ~0]


def _raises(fn):
    try:
        fn()
    except Exception as exc:  # the test looks at which
        return exc
    return None


def test_a_closed_sender_lets_go_of_the_receivers_agent_once():
    agent, _, _, tx, _, _ = pair(2)
    assert agent.users == 1
    tx.close()
    tx.close()  # twice (a GRANT after a teardown closes again): still one disconnect
    assert agent.users == 0


def reading_sender(agent, pool, grant, quarantine_s):
    """A second sender on `pair`'s receiver whose parts wait in 4 staging slots of its own,
    for the receiver to read (`nixl_read`)."""
    staging = LandingPool(agent, 4 * SLOT, SLOT, quarantine_s=quarantine_s)
    tx = NixlSend(agent, pool.descriptor, fallback=None, cap=8, staging=staging)
    tx.on_grant(grant)
    return tx, staging


def test_after_a_failed_read_a_pair_closes_without_reading_its_counter_again():
    # On a reading pair, an unclean close reads the credit counter once more, so that parts
    # the receiver did read free their staging slots at once. Once a read has failed, the
    # receiver's agent is gone: another read fails too, and UCX never returns the request
    # to its pool. The unread slots go to the quarantine without it.
    agent, pool, rx, _, line, grant = pair(4)
    tx, staging = reading_sender(agent, pool, grant, quarantine_s=0.01)
    tx.send_layers(line, layers(4), 1.0)  # 4 parts lent staging slots, none read
    assert tx.reading and staging.num_free == 0
    agent.gone = True
    with pytest.raises(ChannelClosed, match="disconnected"):  # a fifth part waits on the
        tx.send_layers(line, layers(1, 4), 1.0)  # counter, and the read fails
    reads = agent.reads
    tx.close()
    assert agent.reads == reads
    eventually(lambda: staging.num_free == 4, "the unread slots back after the quarantine")


def test_an_unclean_close_reads_the_counter_once_more_while_the_receiver_lives():
    agent, pool, rx, _, line, grant = pair(4)
    tx, staging = reading_sender(agent, pool, grant, quarantine_s=60.0)
    tx.send_layers(line, layers(2), 1.0)
    counter, _ = pool.credit(grant.slots[0])
    counter[0], counter[1] = 2, ~2  # the receiver has read both parts
    reads = agent.reads
    tx.close()
    assert agent.reads == reads + 1
    assert staging.num_free == 4  # read: free at once, not held for the quarantine
