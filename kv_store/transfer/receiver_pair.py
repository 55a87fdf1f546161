"""Receiver end of one pair: builds its channel and runs the receive loop in its own thread.

The loop reads one message at a time (header, then the payload of each LAYER it carries —
one, or a BATCH of them — through the pair's payload path: inline, or a slot of the NIXL
landing pool) and hands each part to the `PairHandler` (the `KVReceiver`), so the layers of
a pair are delivered in the order they were sent; a payload is valid only during the
handler's call (the message's landing slots are released, in the pair's credit counter,
right after).
The pair ends when the sender says CLOSE (clean), when the connection breaks, when the sender
stays silent longer than it promised, or on a protocol error (the pair is closed).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

from kv_store.transfer import rendezvous, wire
from kv_store.transfer.auth import FrameAuth, PairKeys
from kv_store.transfer.channel import (
    BACKWARD_TAG,
    FORWARD_TAG,
    RECEIVER_RANK,
    Channel,
    ChannelClosed,
    build_channel,
)
from kv_store.transfer.config import TransferConfig
from kv_store.transfer.nixl_read import RemoteKV
from kv_store.transfer.payload import InlineReceive, ReceivePath
from kv_store.transfer.rendezvous import Hello
from kv_store.transfer.wire import Header, Kind, ProtocolError

log = logging.getLogger(__name__)


class PairHandler(Protocol):
    def on_message(self, pair: ReceiverPair, header: Header,
                   payload: torch.Tensor | RemoteKV | None) -> None:
        """A LAYER (with its payload), DONE or ABORT message arrived on `pair`."""

    def on_down(self, pair: ReceiverPair, reason: str) -> None:
        """The pair ended; requests still bound to it must fail with `reason`."""


class ReceiverPair:
    """One pair from a sender to this receiver."""

    def __init__(
        self, pair_id: int, hello: Hello, store: dist.Store, host: str,
        cuda_device: torch.device | None, config: TransferConfig, handler: PairHandler,
        keys: PairKeys | None = None, on_parts: Callable[[int], None] | None = None,
    ) -> None:
        """`on_parts(n)`: a message carrying n LAYER parts arrived (for the counters)."""
        self.pair_id = pair_id
        self._on_parts = on_parts
        self._path: ReceivePath = InlineReceive()
        self._auth = FrameAuth.for_end(keys, sender=False) if keys is not None else None
        self.peer = hello.sender
        self._hello = hello
        self._store = store
        self._host = host
        self._cuda_device = cuda_device
        self._config = config
        self._handler = handler
        self._channel: Channel | None = None
        self._lock = threading.Lock()
        self._ended = False
        self._close_deadline: float | None = None
        self.last_used = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"kv-recv {self.peer}", daemon=True)

    def start(self, path: ReceivePath | None = None) -> None:
        """Run the pair; `path` moves its payloads (default: inline)."""
        if path is not None:
            self._path = path
        self._thread.start()

    def request_close(self, reason: str) -> None:
        """Ask the sender to close this pair (it answers CLOSE); forced after close_timeout_s."""
        channel = self._channel
        with self._lock:
            if self._ended or self._close_deadline is not None:
                return
            self._close_deadline = time.monotonic() + self._config.close_timeout_s
        try:
            if channel is not None:
                channel.send(BACKWARD_TAG, Header(Kind.CLOSE, reason=reason), None,
                             self._config.close_timeout_s)
        except ChannelClosed:
            self.abort()

    @property
    def nixl(self) -> bool:
        """Whether payloads of this pair land in NIXL landing slots (or are read)."""
        return getattr(self._path, "num_slots", 0) > 0

    @property
    def reading(self) -> bool:
        """Whether this pair reads its payloads from the sender's staging pool."""
        return getattr(self._path, "reading", False)

    @property
    def closing(self) -> bool:
        """A close was requested or the pair already ended."""
        return self._ended or self._close_deadline is not None

    def overdue(self, now: float) -> bool:
        """True if a requested close was not answered in time."""
        deadline = self._close_deadline
        return deadline is not None and now >= deadline and not self._ended

    def abort(self) -> None:
        """Close the pair now; the receive loop ends and reports the pair down."""
        with self._lock:
            self._ended = True
            channel = self._channel
        if channel is not None:
            channel.abort()

    def join(self, timeout_s: float) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        reason = f"sender {self.peer} closed the pair"
        clean = False
        try:
            self._build()
            self._path.start(self._channel, self._config.io_timeout_s)
            while (header := self._next()) is not None:
                self.last_used = time.monotonic()
                if header.kind in (Kind.LAYER, Kind.BATCH):
                    self._deliver(wire.layers_of(header))
                elif header.kind is Kind.OFFER:
                    self._path.on_offer(header)
                elif header.kind is Kind.GRANT:
                    raise ProtocolError("a GRANT from the sender")
                else:
                    self._handler.on_message(self, header, None)
            clean = True
        except ProtocolError as exc:
            reason = f"protocol error from sender {self.peer}, pair closed: {exc}"
            log.warning("%s", reason)
        except (ChannelClosed, RuntimeError) as exc:  # RuntimeError: rendezvous failures
            reason = f"pair to sender {self.peer} broke: {exc}"
        finally:
            self.abort()
            self._path.close(clean)
            self._handler.on_down(self, reason)

    def _build(self) -> None:
        channel = build_channel(
            rendezvous.pair_store(self._store, self.pair_id), RECEIVER_RANK, self._host,
            self._cuda_device, self._config, self._auth,
        )
        with self._lock:
            self._channel = channel
            aborted = self._ended
        if aborted:  # closed while the rendezvous was running
            channel.abort()
            raise ChannelClosed("receiver closed during rendezvous")

    def _next(self) -> Header | None:
        """The next LAYER/DONE/ABORT header; None when the sender closes the pair."""
        header = self._channel.recv_header(FORWARD_TAG, self._hello.quiet_limit_s)
        return None if header.kind is Kind.CLOSE else header

    def _deliver(self, parts: tuple[Header, ...]) -> None:
        """Hand over a message's LAYER parts one by one (a refused part's payload is still
        read, so framing holds), then release their payloads together."""
        if self._on_parts is not None:
            self._on_parts(len(parts))
        taken: list[Header] = []
        try:
            for part in parts:
                payload = self._payload(part)
                taken.append(part)
                self._handler.on_message(self, part, payload)
        finally:
            if taken:
                self._path.release(self._channel, taken, self._config.io_timeout_s)

    def _payload(self, header: Header) -> torch.Tensor | RemoteKV:
        nbytes = wire.payload_nbytes(header.shape, header.dtype)
        if nbytes > self._config.max_message_bytes:
            raise ProtocolError(f"payload of {nbytes} bytes exceeds max_message_bytes")
        return self._path.payload(self._channel, header, self._config.io_timeout_s)
