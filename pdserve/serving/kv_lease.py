"""One lease per KV hand-off: the only timeout of a transfer, decided once, by the receiver.

The decode worker D grants the lease when it reserves blocks (the request's deadline may cut
it shorter) and everyone enforces that same deadline, so whichever party notices first ends
the transfer and the others agree:

    D reserves blocks ─── lease L ─────────────────────────────────────────────┐
      │ ready{kv_lease_s = L} ─► router ─► P (KVTarget.lease_s = what is left)  │
      │                                    P's sender: lease, every header says │
      │                                    how much is left                     ▼
      ├ D's sink: KV not all landed by then ─► request ABORTED, blocks freed (router migrates)
      ├ D's receiver: DONE not arrived by then ─► transfer FAILED, late parts dropped
      └ P's sender: DONE not on the wire by then ─► queued layers dropped, ABORT to D

A pull works the same with its own, shorter lease (past it, recomputing is the better bet),
granted when D reserves the pull's blocks; the PushKV call and the pushing worker's sender
run on what is left of it. Nothing else in a transfer times out on its own: the transport's
`io_timeout_s` and `connect_timeout_s` bound single wire operations and pair set-up only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kv_store.transfer import TransferConfig


@dataclass(frozen=True)
class LeaseConfig:
    """The hand-off leases of one worker (`--kv-lease-s`, `--kv-pull-lease-s`)."""

    kv_lease_s: float = 30.0
    """Remote prefill: from D's reservation until every part of the prompt's KV has landed on
    every D rank, the prefill worker's queue and compute included."""
    pull_lease_s: float = 5.0
    """Pull: from D's reservation of the pull's blocks until they have landed."""

    def __post_init__(self) -> None:
        for name in ("kv_lease_s", "pull_lease_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")

    def transfer_config(self, host: str = "", auth_key: bytes | None = None,
                        backend: str = "auto", nixl_reads: bool = True) -> TransferConfig:
        """The transfer engine's config, whose cap on any lease is the longest of these;
        `host`, `auth_key`, `backend`, `nixl_reads` as in `TransferConfig` (the worker's bind
        address, its KV key, its torch.distributed transport and whether its NIXL pairs on
        one host read: `pdserve.serving.kv_transport`)."""
        return TransferConfig(lease_s=max(self.kv_lease_s, self.pull_lease_s), host=host,
                              auth_key=auth_key, backend=backend, nixl_reads=nixl_reads)


@dataclass(frozen=True)
class Lease:
    """A lease's end on this process's monotonic clock."""

    expires_at: float

    @classmethod
    def start(cls, limit_s: float, deadline_unix_s: float = 0.0) -> Lease:
        """A lease of `limit_s`, cut to what is left of the request's deadline (0: none)."""
        seconds = limit_s
        if deadline_unix_s > 0:
            seconds = min(seconds, deadline_unix_s - time.time())
        return cls(time.monotonic() + max(seconds, 0.0))

    def left(self) -> float:
        return max(0.0, self.expires_at - time.monotonic())

    @property
    def expired(self) -> bool:
        return time.monotonic() >= self.expires_at
