"""Authenticated transfer pairs: only a sender holding the cluster's KV key opens a pair, and
nothing written into the receiver's (unauthenticated) TCPStore by anyone else opens one.
Senders run in spawned agent processes (tests/kv_store/test_transfer.py)."""

from __future__ import annotations

from datetime import timedelta

import msgpack
import pytest
import torch
import torch.distributed as dist

from kv_store.transfer import KVReceiver, TransferConfig, wire
from kv_store.transfer.auth import FrameAuth, Opener, PairKeys, Sealer
from kv_store.transfer.wire import ProtocolError
from tests.kv_store.test_transfer import FAST, Agent, RecordingSink, wait_until

KEY = b"k" * 32
OTHER = b"o" * 32


@pytest.fixture(scope="module")
def agent():
    a = Agent()
    yield a
    a.stop()


@pytest.fixture
def receiver():
    sink = RecordingSink()
    rx = KVReceiver("127.0.0.1", 0, sink, TransferConfig(auth_key=KEY, **FAST))
    rx.start()
    rx.sink = sink
    yield rx
    rx.close()


def _send(agent, address, rid, key):
    config = {**FAST, "connect_timeout_s": 5.0, **({"auth_key": key} if key else {})}
    return agent.call("send", address=address, rid=rid, layers=2, n=3, dtype="float32",
                      meta={"first_token": 7}, config=config)


def test_a_signed_pair_carries_kv_bit_exact(agent, receiver):
    out = _send(agent, receiver.address, "signed", KEY)
    assert out["state"] == "done", out
    assert receiver.sink.wait_for("done", "signed")[2] == {"first_token": 7}
    receiver.sink.assert_exact("signed", 2, 3, torch.float32)


def test_senders_without_the_key_are_refused_and_the_receiver_keeps_serving(agent, receiver):
    for rid, key in (("unsigned", None), ("wrong-key", OTHER)):
        out = _send(agent, receiver.address, rid, key)
        assert out["state"] == "failed" and "error" in out, out
        assert receiver.sink.kinds(rid) == []  # not a single frame reached the sink
    assert receiver.stats()["pairs_refused"] == 2
    assert _send(agent, receiver.address, "after", KEY)["state"] == "done"
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
    assert _send(agent, receiver.address, "real", KEY)["state"] == "done"
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
    assert receiver.sink.kinds("real") == ["layer", "layer", "done"]


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
