"""The transport interface: how one pair moves LAYER payloads.

Everything else about a transfer is the same whatever carries the bytes — the pair's sealed,
ordered control frames over gloo, tickets, leases, the state machines of `state` — so a pair
differs from another only in its payload path, chosen when the pair opens:

    sender pair thread:    item ─► SendPath.send_layer(channel, item) ─► header(s) (+ bytes)
    sender reader thread:  GRANT ─► SendPath.on_grant(header)
    receiver pair thread:  start(channel) ─► header ─► payload(channel, header) ─► handler
                           ─► release(channel, header) ... ─► close(clean)

`InlineSend` / `InlineReceive` (here): the payload tensor follows its header on the pair —
gloo for CPU tensors, NCCL for CUDA ones (`Channel`). `NixlSend` / `NixlReceive`
(`nixl_path`): the sender writes the bytes into a slot of the receiver's registered landing
pool with NIXL, then sends a header naming the slot; the receiver copies them out and grants
the slot back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from kv_store.transfer.channel import FORWARD_TAG, Channel
from kv_store.transfer.wire import Header, ProtocolError

if TYPE_CHECKING:
    from kv_store.transfer.sender_pair import Outgoing


class SendPath(Protocol):
    """The sender end of a pair's payload path (used by the pair's two threads)."""

    def send_layer(self, channel: Channel, item: Outgoing, timeout_s: float) -> int:
        """Put one LAYER message (header and bytes) on the pair; payload bytes moved.
        `ChannelClosed` when the pair cannot carry it."""

    def on_grant(self, header: Header) -> None:
        """The receiver handed over landing slots (GRANT on the backward direction)."""

    def close(self) -> None:
        """The pair ended: wake and fail any wait."""


class ReceivePath(Protocol):
    """The receiver end of a pair's payload path (used by the pair's receive thread)."""

    def start(self, channel: Channel, timeout_s: float) -> None:
        """The pair is open (tell the sender what it may use)."""

    def payload(self, channel: Channel, header: Header, timeout_s: float) -> torch.Tensor:
        """The payload of a LAYER header, valid until `release` (`ProtocolError` if the
        header names something this pair was not given)."""

    def release(self, channel: Channel, header: Header, timeout_s: float) -> None:
        """The handler is done with the payload of `header`."""

    def close(self, clean: bool) -> None:
        """The pair ended (`clean`: by the close handshake, so the sender writes no more)."""


class InlineSend:
    """Payload tensors follow their header on the pair (gloo, or NCCL for CUDA pairs)."""

    def send_layer(self, channel: Channel, item: Outgoing, timeout_s: float) -> int:
        if item.ready is not None:  # order our stream after the producer's
            torch.cuda.current_stream(item.payload.device).wait_event(item.ready)
        return channel.send(FORWARD_TAG, item.header, item.payload, timeout_s)

    def on_grant(self, header: Header) -> None:
        raise ProtocolError("GRANT on a pair without a landing pool")

    def close(self) -> None:
        pass


class InlineReceive:
    """The receiving end of `InlineSend`: each payload is received into a fresh tensor."""

    def start(self, channel: Channel, timeout_s: float) -> None:
        pass

    def payload(self, channel: Channel, header: Header, timeout_s: float) -> torch.Tensor:
        return channel.recv_payload(FORWARD_TAG, header, timeout_s)

    def release(self, channel: Channel, header: Header, timeout_s: float) -> None:
        pass

    def close(self, clean: bool) -> None:
        pass

