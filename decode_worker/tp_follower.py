"""The decode role on a follower rank: receive this rank's KV heads from prefill workers.

Rank 0 reserves blocks and broadcasts each expectation (`expect`) and cancellation (`cancel`)
before it answers the router or releases the blocks, so a follower never writes a block it
was not told about or that was released. A follower reports each request's completion (or
failure) under `kvready/<request>/<rank>` in the group's store; rank 0 waits for all of them
before the request runs.
"""

from __future__ import annotations

from decode_worker.kv_sink import DecodeKVSink
from kv_store.tp_layout import heads_of
from kv_store.transfer import KVReceiver, TransferConfig
from pdserve.engine.tp.follower import FollowerPlugin
from pdserve.serving.security.config import kv_auth_key


def ready_key(request_id: str, rank: int) -> str:
    return f"kvready/{request_id}/{rank}"


def endpoint_key(rank: int) -> str:
    return f"kv_endpoint/{rank}"


class DecodeFollower(FollowerPlugin):
    def __init__(self, engine, group, host: str) -> None:
        super().__init__(engine, group, host)
        ctx = group.context
        self.rank = ctx.rank
        store = group.store
        heads = heads_of(engine.model_config.num_kv_heads, ctx.rank, ctx.size)
        self.sink = DecodeKVSink(
            engine.runner.caches,
            on_ready=lambda rid, meta: store.set(ready_key(rid, self.rank), "ok"),
            on_error=lambda rid, why: store.set(ready_key(rid, self.rank), f"fail: {why}"),
            head_start=heads.start, primary=False)
        config = TransferConfig(host=host, auth_key=kv_auth_key())
        self.receiver = KVReceiver(host, 0, self.sink, config)
        self.receiver.start()
        store.set(endpoint_key(self.rank), self.receiver.address)

    def on_message(self, msg: dict) -> None:
        if msg["op"] == "expect":
            self.sink.expect(msg["rid"], list(msg["blocks"]), int(msg["skip"]),
                             float(msg["timeout"]))
        elif msg["op"] == "cancel":
            self.sink.cancel(msg["rid"])

    def close(self) -> None:
        self.receiver.close()
