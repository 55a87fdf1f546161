"""The transport interface: how one pair moves LAYER payloads.

Everything else about a transfer is the same whatever carries the bytes — the pair's sealed,
ordered control frames over gloo, tickets, leases, the state machines of `state` — so a pair
differs from another only in its payload path, chosen when the pair opens:

    sender pair thread:    items ─► SendPath.send_layers(channel, items) ─► message(s)
    sender reader thread:  GRANT ─► SendPath.on_grant(header)   (NIXL: once, at the start)
    receiver pair thread:  start(channel) ─► message ─► payload(channel, part) ─► handler,
                           for each LAYER part ─► release(channel, parts) ... ─► close(clean)
                           (NIXL, same host: OFFER ─► on_offer(header), once, first)

The pair thread hands the path every LAYER that is queued (up to `coalesce_max_parts`), and
the path puts parts that are ready together into one message (`coalesce`).

`InlineSend` / `InlineReceive` (here): the payload tensor follows its header on the pair —
gloo for CPU tensors, NCCL for CUDA ones (`Channel`). `NixlSend` / `NixlReceive`
(`nixl_path`): the sender writes the bytes into a slot of the receiver's registered landing
pool with NIXL, then sends a header naming the slot; the receiver copies them out and counts
the slot released in the pair's credit counter, which the sender reads. On one host the
sender offers slots of its own staging pool instead, and the receiver reads from them
(`nixl_read`): its payloads are then `RemoteKV`s, which a sink lands itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from kv_store.transfer import wire
from kv_store.transfer.channel import FORWARD_TAG, Channel
from kv_store.transfer.coalesce import parts_per_message
from kv_store.transfer.wire import Header, ProtocolError

if TYPE_CHECKING:
    from kv_store.transfer.nixl_read import RemoteKV
    from kv_store.transfer.sender_pair import Outgoing


class SendPath(Protocol):
    """The sender end of a pair's payload path (used by the pair's two threads)."""

    def send_layers(self, channel: Channel, items: Sequence[Outgoing],
                    timeout_s: float) -> list[int]:
        """Put these LAYERs (headers and bytes, in order) on the pair, coalesced into as few
        messages as the policy allows; the payload bytes of each item. `timeout_s` bounds
        each wait. `ChannelClosed` when the pair cannot carry them."""

    @property
    def batch_limit(self) -> int:
        """Most queued LAYERs the pair hands over at once: one message's worth, so a
        request's lease is checked again before each message."""

    def on_grant(self, header: Header) -> None:
        """The receiver handed over landing slots (GRANT on the backward direction)."""

    def close(self, clean: bool = False) -> None:
        """The pair ended (`clean`: the receiver hung up after the close handshake, so it
        reads nothing more): wake and fail any wait."""


class ReceivePath(Protocol):
    """The receiver end of a pair's payload path (used by the pair's receive thread)."""

    def start(self, channel: Channel, timeout_s: float) -> None:
        """The pair is open (tell the sender what it may use)."""

    def on_offer(self, header: Header) -> None:
        """The sender offered its staging slots (OFFER; `ProtocolError` where it may not)."""

    def payload(self, channel: Channel, header: Header, timeout_s: float
                ) -> torch.Tensor | RemoteKV:
        """The payload of a LAYER header, valid until `release` (`ProtocolError` if the
        header names something this pair was not given)."""

    def release(self, channel: Channel, parts: Sequence[Header], timeout_s: float) -> None:
        """The handler is done with the payloads of these LAYER parts (one message's)."""

    def close(self, clean: bool) -> None:
        """The pair ended (`clean`: by the close handshake, so the sender writes no more)."""


class InlineSend:
    """Payload tensors follow their header on the pair (gloo, or NCCL for CUDA pairs)."""

    def __init__(self, cap: int = 1) -> None:
        self._cap = cap  # `coalesce_max_parts` (1 on NCCL pairs)

    @property
    def batch_limit(self) -> int:
        return self._cap

    def send_layers(self, channel: Channel, items: Sequence[Outgoing],
                    timeout_s: float) -> list[int]:
        sizes: list[int] = []
        while len(sizes) < len(items):
            run = items[len(sizes):len(sizes) + parts_per_message(len(items) - len(sizes),
                                                                   self._cap)]
            for item in run:
                if item.ready is not None:  # order our stream after the producer's
                    torch.cuda.current_stream(item.payload.device).wait_event(item.ready)
            header = wire.batch(tuple(item.header for item in run))
            sizes += channel.send_frame(FORWARD_TAG, header, [it.payload for it in run],
                                        timeout_s)
        return sizes

    def on_grant(self, header: Header) -> None:
        raise ProtocolError("GRANT on a pair without a landing pool")

    def close(self, clean: bool = False) -> None:
        pass


class InlineReceive:
    """The receiving end of `InlineSend`: each payload is received into a fresh tensor."""

    def start(self, channel: Channel, timeout_s: float) -> None:
        pass

    def on_offer(self, header: Header) -> None:
        raise ProtocolError("OFFER on a pair without NIXL")

    def payload(self, channel: Channel, header: Header, timeout_s: float) -> torch.Tensor:
        return channel.recv_payload(header, timeout_s)

    def release(self, channel: Channel, parts: Sequence[Header], timeout_s: float) -> None:
        pass

    def close(self, clean: bool) -> None:
        pass

