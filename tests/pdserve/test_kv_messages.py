"""The typed DONE messages of a KV hand-off and the one lease model's arithmetic."""

from __future__ import annotations

import time

import msgpack
import pytest

from pdserve.serving import kv_messages
from pdserve.serving.kv_lease import Lease, LeaseConfig
from pdserve.serving.kv_messages import MessageError, PartsDone, PrefillDone, PullDone


@pytest.mark.parametrize("msg", [PrefillDone(17, -0.5, 1.7e9), PrefillDone(0), PartsDone(),
                                 PullDone(12)])
def test_messages_round_trip(msg):
    assert kv_messages.decode(kv_messages.encode(msg)) == msg


@pytest.mark.parametrize("doc, what", [
    ({"v": 2, "type": "pull", "blocks": 1}, "version"),
    ({"v": 1, "type": "teleport"}, "type"),
    ({"v": 1, "type": "pull", "blocks": -1}, "blocks"),
    ({"v": 1, "type": "pull", "blocks": True}, "blocks"),
    ({"v": 1, "type": "prefill", "token_id": 3, "logprob": "x", "sampled_at": 0.0}, "logprob"),
    ({"v": 1, "type": "prefill", "token_id": 3, "logprob": None}, "sampled_at"),
    ([1, 2], "map"),
])
def test_malformed_bodies_are_refused_naming_what_is_wrong(doc, what):
    with pytest.raises(MessageError, match=what):
        kv_messages.decode(msgpack.packb(doc))
    with pytest.raises(MessageError):
        kv_messages.decode(b"\xc1")


def test_a_lease_is_cut_by_the_request_deadline_and_caps_the_transfer_engine():
    assert 9.0 < Lease.start(10.0).left() <= 10.0
    assert Lease.start(10.0, time.time() + 2.0).left() <= 2.0
    assert Lease.start(10.0, time.time() - 1.0).expired
    cfg = LeaseConfig(kv_lease_s=12.0, pull_lease_s=3.0)
    assert cfg.transfer_config().lease_s == 12.0
    with pytest.raises(ValueError, match="pull_lease_s"):
        LeaseConfig(pull_lease_s=0)
