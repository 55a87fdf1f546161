"""Authenticated transfer pairs: only a sender holding the cluster's KV key opens a pair, and
nothing written into the receiver's (unauthenticated) TCPStore by anyone else opens one. Bound
transfers: even a sender with the key reaches a request only with the ticket it was handed.
Senders run in spawned agent processes (tests/kv_store/test_transfer.py), once per transport:
over NIXL a refused frame's bytes sit in a landing slot and never reach the sink."""

from __future__ import annotations

from datetime import timedelta

import msgpack
import pytest
import torch
import torch.distributed as dist

from kv_store.transfer import KVReceiver, TransferConfig, new_ticket, wire
from kv_store.transfer.auth import FrameAuth, Opener, PairKeys, Sealer
from kv_store.transfer.wire import ProtocolError
from tests.kv_store.test_transfer import FAST, Agent, RecordingSink, wait_until

KEY = b"k" * 32
OTHER = b"o" * 32


@pytest.fixture(scope="module")
def agent(transport, local_nixl):
    a = Agent(transport)
    yield a
    a.stop()


@pytest.fixture
def receiver(local_nixl):
    sink = RecordingSink()
    rx = KVReceiver("127.0.0.1", 0, sink, TransferConfig(auth_key=KEY, **FAST),
                    nixl=local_nixl)
    rx.start()
    rx.sink = sink
    yield rx
    rx.close()


@pytest.fixture
def bound(local_nixl):
    """A receiver whose requests take only frames tagged under their ticket (`book`)."""
    sink, book = RecordingSink(), {}
    rx = KVReceiver("127.0.0.1", 0, sink, TransferConfig(auth_key=KEY, **FAST),
                    tickets=book.get, nixl=local_nixl)
    rx.start()
    rx.sink, rx.book = sink, book
    yield rx
    rx.close()


def _send(agent, rx, rid, key, ticket=b"", member=0):
    """Send a 2-layer request to `rx` (over its landing pool when it has one); `member`
    picks another sender (another pair) of the agent."""
    config = {**FAST, "connect_timeout_s": 5.0 + member, **({"auth_key": key} if key else {})}
    return agent.call("send", address=rx.address, rid=rid, layers=2, n=3, dtype="float32",
                      body=b"first 7", config=config, ticket=ticket, peer=rx.nixl_descriptor)


def test_a_signed_pair_carries_kv_bit_exact(agent, receiver):
    out = _send(agent, receiver, "signed", KEY)
    assert out["state"] == "done", out
    assert receiver.sink.wait_for("done", "signed")[2] == b"first 7"
    receiver.sink.assert_exact("signed", 2, 3, torch.float32)


def test_senders_without_the_key_are_refused_and_the_receiver_keeps_serving(agent, receiver):
    for rid, key in (("unsigned", None), ("wrong-key", OTHER)):
        out = _send(agent, receiver, rid, key)
        assert out["state"] == "failed" and "error" in out, out
        assert receiver.sink.kinds(rid) == []  # not a single frame reached the sink
    assert receiver.stats()["pairs_refused"] == 2
    assert _send(agent, receiver, "after", KEY)["state"] == "done"
    receiver.sink.wait_for("done", "after")  # the DONE on the wire may not be read yet
    receiver.sink.assert_exact("after", 2, 3, torch.float32)


def _store(receiver) -> dist.TCPStore:
    host, port = receiver.address.rsplit(":", 1)
    return dist.TCPStore(host, int(port), None, False, timedelta(seconds=5))


def _offer(store, pair_id: int, hello: bytes) -> dict:
    store.set(f"pairs/{pair_id}/hello", hello)
    store.queue_push("pairs/hello", str(pair_id))
    store.wait([f"pairs/{pair_id}/reply"], timedelta(seconds=5))
    return msgpack.unpackb(store.get(f"pairs/{pair_id}/reply"))


def test_forged_and_replayed_hellos_in_the_store_open_nothing(agent, receiver):
    assert _send(agent, receiver, "real", KEY)["state"] == "done"
    store = _store(receiver)
    signed = store.get("pairs/1/hello")  # what the real sender wrote, readable by anyone
    forged = wire.pack({"kind": "hello", "sender": "x:1", "host": "127.0.0.1",
                        "transport": "gloo", "quiet_limit_s": 5.0, "nonce": b"n" * 16,
                        "mac": b"m" * 32})
    for hello in (forged, signed):  # a made-up signature; a real one under another pair id
        reply = _offer(store, store.add("pairs/next", 1), hello)
        assert reply["ok"] is False and "MAC" in reply["reason"]
    store.queue_push("pairs/hello", "1")  # the real pair's id again: ignored
    assert wait_until(lambda: receiver.stats()["pairs_refused"] == 2)
    assert receiver.stats()["pairs_open"] <= 1
    receiver.sink.wait_for("done", "real")
    assert receiver.sink.kinds("real") == ["layer", "layer", "done"]


def test_queue_entries_without_a_hello_stall_no_real_offer(agent, receiver):
    store = _store(receiver)
    store.queue_push("pairs/hello", "not-a-pair-id")
    for _ in range(3):  # ids nobody wrote a hello for: each used to hold the accept loop
        store.queue_push("pairs/hello", str(store.add("pairs/next", 1)))  # for its timeout
    out = agent.call("send", address=receiver.address, rid="behind", layers=1, n=1,
                     dtype="float32", config={**FAST, "connect_timeout_s": 3.0,
                                              "auth_key": KEY}, peer=receiver.nixl_descriptor)
    assert out["state"] == "done", out
    receiver.sink.wait_for("done", "behind")


def test_frames_verify_only_under_their_key_and_in_sequence():
    keys = PairKeys.derive(KEY, 1, b"s" * 16, b"r" * 16)
    sender, receiver = FrameAuth.for_end(keys, True), FrameAuth.for_end(keys, False)
    frames = [sender.sealer.seal(wire.encode_header(wire.Header(wire.Kind.DONE, rid=f"r{i}")))
              for i in range(3)]
    assert wire.decode_header(receiver.opener.open(frames[0])).rid == "r0"
    for bad in (frames[0], frames[2]):  # a replay; a frame out of order
        with pytest.raises(ProtocolError, match="MAC"):
            receiver.opener.open(bad)
    assert wire.decode_header(receiver.opener.open(frames[1])).rid == "r1"
    hijacker = Sealer(PairKeys.derive(OTHER, 1, b"s" * 16, b"r" * 16).forward)
    with pytest.raises(ProtocolError, match="MAC"):
        Opener(keys.forward).open(hijacker.seal(b"\x81\xa1v\x03"))
    with pytest.raises(ProtocolError, match="MAC"):  # a direction's key opens only its own
        Opener(keys.backward).open(Sealer(keys.forward).seal(b"x"))


def test_a_member_with_the_key_but_not_the_ticket_reaches_no_request(agent, bound):
    bound.book["victim"] = ticket = new_ticket()
    for member, forged in ((1, new_ticket()), (2, b"")):  # a ticket of its own; none at all
        for rid in ("victim", "stranger"):
            assert _send(agent, bound, rid, KEY, forged, member)["state"] == "done"
    assert wait_until(lambda: bound.stats()["frames_refused"] == 6)  # 2 layers + DONE, twice
    # "stranger" was never expected: dropped without a record
    assert bound.sink.kinds("victim") == [] and bound.sink.kinds("stranger") == []
    assert _send(agent, bound, "victim", KEY, ticket)["state"] == "done"
    assert bound.sink.wait_for("done", "victim")[2] == b"first 7"
    bound.sink.assert_exact("victim", 2, 3, torch.float32)
    bound.book["next"] = nxt = new_ticket()  # the refusing pair still carries real work
    assert _send(agent, bound, "next", KEY, nxt, member=1)["state"] == "done"
    bound.sink.wait_for("done", "next")
    bound.sink.assert_exact("next", 2, 3, torch.float32)


def test_late_frames_of_an_earlier_transfer_of_the_same_id_are_refused(agent, bound):
    earlier, now = new_ticket(), new_ticket()
    bound.book["again"] = now  # the request was reserved anew (a retry) since `earlier`
    assert _send(agent, bound, "again", KEY, earlier, member=1)["state"] == "done"
    assert wait_until(lambda: bound.stats()["frames_refused"] == 3)
    assert bound.sink.kinds("again") == []
    assert _send(agent, bound, "again", KEY, now)["state"] == "done"
    bound.sink.wait_for("done", "again")
    bound.sink.assert_exact("again", 2, 3, torch.float32)
