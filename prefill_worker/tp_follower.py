"""The prefill role on a follower rank: send this rank's KV heads of each step's blocks."""

from __future__ import annotations

from kv_store.transfer import KVSender
from pdserve.engine.tp.follower import FollowerPlugin
from pdserve.serving.kv_lease import LeaseConfig
from pdserve.serving.kv_transport import (
    default_kv_transport,
    default_nixl_reads,
    open_kv_transport,
)
from pdserve.serving.security.config import kv_auth_key
from prefill_worker.kv_streamer import BlockSend, KVStreamer


class PrefillFollower(FollowerPlugin):
    def __init__(self, engine, group, host: str) -> None:
        super().__init__(engine, group, host)
        # Every lease comes from rank 0's sends; the default config only caps them. The KV
        # key, transport and read mode come from the environment rank 0 passed down.
        self.kv = open_kv_transport(default_kv_transport(), host)
        self.sender = KVSender(LeaseConfig().transfer_config(
            host=host, auth_key=kv_auth_key(), backend=self.kv.backend,
            nixl_reads=default_nixl_reads()), nixl=self.kv.nixl)
        ctx = group.context
        self.streamer = KVStreamer(self.sender, engine.kv_caches, engine.config.block_size,
                                   engine.kv_layout, ctx.rank, ctx.size)

    def before_step(self, extra: dict):
        self._sends = [BlockSend.from_wire(row) for row in extra.get("sends", ())]
        return self.streamer.layer_hook(self._sends)

    def after_step(self, extra: dict) -> None:
        for s in self._sends:
            if s.last:  # the prompt is complete: close this rank's pairs for the request
                self.streamer.finish(s.request_id, None, s.lease_s, s.ticket)
                self.streamer.sent_bytes.pop(s.request_id, None)

    def close(self) -> None:
        self.sender.close()
        self.kv.close()
