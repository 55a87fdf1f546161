"""The decode role on a follower rank: receive this rank's KV heads from other workers.

Rank 0 reserves blocks and broadcasts each expectation (`KVExpect`) and cancellation
(`KVCancel`) before it answers the router or frees the blocks, so a follower never writes a
block it was not told about or that was freed. A follower reports each request's completion
(or failure) under `kvready/<request>/<rank>` in the group's store; rank 0 waits for all of
them, within the hand-off's lease, before the request runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from decode_worker.kv_sink import DecodeKVSink
from kv_store.transfer import KVReceiver
from pdserve.engine.tp.follower import FollowerPlugin
from pdserve.serving.kv_lease import Lease, LeaseConfig
from pdserve.serving.kv_messages import PrefillDone, PullDone
from pdserve.serving.kv_transport import default_kv_transport, open_kv_transport
from pdserve.serving.security.config import kv_auth_key


def ready_key(request_id: str, rank: int) -> str:
    return f"kvready/{request_id}/{rank}"


def endpoint_key(rank: int) -> str:
    return f"kv_endpoint/{rank}"


def nixl_key(rank: int) -> str:
    """Where a follower publishes its NIXL landing pool (empty: none)."""
    return f"kv_nixl/{rank}"


@dataclass(frozen=True)
class KVExpect:
    """Rank 0 → followers: accept KV for `blocks[skip:]` of a request, for `lease_s`, in
    frames tagged under `ticket` (the one rank 0 handed out for this transfer)."""

    rid: str
    blocks: tuple[int, ...]
    skip: int
    lease_s: float
    ticket: bytes = field(repr=False)
    pull: bool = False

    def to_wire(self) -> dict:
        return {"op": "expect", "rid": self.rid, "blocks": list(self.blocks),
                "skip": self.skip, "lease_s": self.lease_s, "ticket": self.ticket,
                "pull": self.pull}

    @classmethod
    def from_wire(cls, msg: dict) -> KVExpect:
        ticket = msg["ticket"]
        if not isinstance(ticket, bytes):
            raise ValueError("KVExpect.ticket must be bytes")
        return cls(str(msg["rid"]), tuple(int(b) for b in msg["blocks"]), int(msg["skip"]),
                   float(msg["lease_s"]), ticket, bool(msg["pull"]))


@dataclass(frozen=True)
class KVCancel:
    """Rank 0 → followers: accept no more KV for a request (its blocks are being freed)."""

    rid: str

    def to_wire(self) -> dict:
        return {"op": "cancel", "rid": self.rid}


class DecodeFollower(FollowerPlugin):
    def __init__(self, engine, group, host: str) -> None:
        super().__init__(engine, group, host)
        ctx = group.context
        self.rank = ctx.rank
        store = group.store
        heads = engine.kv_layout.heads_of(ctx.rank, ctx.size)
        self.sink = DecodeKVSink(
            engine.kv_caches,
            on_ready=lambda rid, done, lease: store.set(ready_key(rid, self.rank), "ok"),
            on_error=lambda rid, why: store.set(ready_key(rid, self.rank), f"fail: {why}"),
            head_start=heads.start, primary=False)
        # Follower ranks are started by rank 0 with its engine options only: they take the
        # default cap on leases; every lease they enforce comes from rank 0's messages. The
        # KV key and transport come from the environment rank 0 passed down.
        self.kv = open_kv_transport(default_kv_transport(), host)
        config = LeaseConfig().transfer_config(host=host, auth_key=kv_auth_key(),
                                               backend=self.kv.backend)
        self.receiver = KVReceiver(host, 0, self.sink, config, tickets=self.sink.ticket,
                                   nixl=self.kv.nixl, nixl_device=engine.kv_caches[0].device,
                                   nixl_destinations=engine.kv_caches)
        self.receiver.start()
        store.set(nixl_key(self.rank), self.receiver.nixl_descriptor)
        store.set(endpoint_key(self.rank), self.receiver.address)

    def on_message(self, msg: dict) -> None:
        if msg["op"] == "expect":
            e = KVExpect.from_wire(msg)
            self.sink.expect(e.rid, e.blocks, e.skip, Lease.start(e.lease_s), e.ticket,
                             PullDone if e.pull else PrefillDone)
        elif msg["op"] == "cancel":
            self.sink.cancel(msg["rid"])

    def close(self) -> None:
        self.receiver.close()
        self.kv.close()
