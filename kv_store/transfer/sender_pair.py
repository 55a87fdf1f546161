"""Sender end of one pair: its ordered send queue, its send thread and its back-channel reader.

Pair lifecycle::

    CONNECTING ──rendezvous done──► OPEN ──close() / receiver asks to close──► CLOSING ──► CLOSED
         │                           │                                            │
         └───────── rendezvous refused or failed, connection lost, protocol error ┴──► BROKEN

Messages leave in the order they were queued; an abort jumps the queue; LAYERs that are queued
together are handed to the payload path at once, which coalesces them (`coalesce`: at most
`coalesce_max_parts`). The send thread is the only writer of the forward direction; the
reader thread waits on the backward direction (close requests, and the one GRANT of a
NIXL pair's landing slots), so a dead receiver is noticed at once even while the pair is
quiet. LAYER payloads go through the pair's payload path (`payload`): inline on gloo/NCCL,
or NIXL writes into the receiver's landing pool (`nixl_path`). The pair never decides about
requests: it tells its `PairListener` (the `KVSender`) what goes on the wire and when it is
down.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

import torch

from kv_store.transfer import rendezvous
from kv_store.transfer.auth import FrameAuth
from kv_store.transfer.channel import (
    BACKWARD_TAG,
    FORWARD_TAG,
    SENDER_RANK,
    Channel,
    ChannelClosed,
    build_channel,
)
from kv_store.transfer.config import TransferConfig
from kv_store.transfer.nixl_agent import NixlAgent
from kv_store.transfer.nixl_path import LandingPool, NixlDescriptor, NixlSend
from kv_store.transfer.payload import InlineSend, SendPath
from kv_store.transfer.wire import MAX_BATCH_BLOCKS, Header, Kind, ProtocolError

log = logging.getLogger(__name__)
_NEVER_S = 30 * 86400.0  # the reader's wait: it ends when the pair closes, not on a clock


class PairState(Enum):
    CONNECTING = "connecting"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"
    BROKEN = "broken"


@dataclass(frozen=True)
class Outgoing:
    """One queued message; `payload` is set for LAYER messages only."""

    header: Header
    payload: torch.Tensor | None = None
    ready: Any = None
    """CUDA event recorded on the producer's stream: the payload may still be being computed."""
    ticket: bytes = field(default=b"", repr=False)
    """The transfer's ticket: a payload path that splits a LAYER tags each part under it."""


class PairListener(Protocol):
    def on_wire(self, pair: SenderPair, item: Outgoing) -> bool:
        """About to send `item`; return False to skip it (its request already ended)."""

    def on_sent(self, pair: SenderPair, item: Outgoing, nbytes: int) -> None:
        """`item` is on the wire; `nbytes` payload bytes."""

    def on_down(self, pair: SenderPair, reason: str) -> None:
        """The pair is CLOSED or BROKEN; requests still bound to it must fail."""


class SenderPair:
    """One pair from this process to the receiver at `address`, with its two threads."""

    def __init__(
        self,
        address: str,
        transport: str,
        cuda_device: torch.device | None,
        config: TransferConfig,
        listener: PairListener,
        nixl: tuple[NixlAgent, NixlDescriptor, LandingPool | None] | None = None,
    ) -> None:
        """`nixl`: this process's agent, the receiver's landing pool and, for a receiver on
        this host, this process's staging pool (`nixl_read`), for a pair whose `transport`
        is "nixl"."""
        self.address = address
        self.transport = transport
        self.cuda_device = cuda_device
        self._config = config
        self._listener = listener
        self._cv = threading.Condition()
        self._queue: deque[Outgoing] = deque()
        self._state = PairState.CONNECTING
        self._sending = False
        self._close_reason = ""
        self._channel: Channel | None = None
        self._nixl = nixl
        # NCCL pairs send one part per message (coalescing there is untested on hardware)
        self._cap = 1 if transport == "nccl" else config.coalesce_max_parts
        self._path: SendPath = InlineSend()
        self._store = None  # the TCPStore client; NCCL initialises lazily through it
        self.last_used = time.monotonic()
        self.key = (address, transport, str(cuda_device))
        self._sender = threading.Thread(target=self._run, name=f"kv-send {address}", daemon=True)
        self._reader = threading.Thread(target=self._read, name=f"kv-back {address}", daemon=True)

    # ---- called by the KVSender --------------------------------------------------------------

    def start(self) -> None:
        self._sender.start()

    @property
    def state(self) -> PairState:
        return self._state

    @property
    def accepting(self) -> bool:
        return self._state in (PairState.CONNECTING, PairState.OPEN)

    @property
    def reading(self) -> bool:
        """The receiver reads this pair's payloads from our staging pool (`nixl_read`)."""
        return getattr(self._path, "reading", False)

    @property
    def slot_waits(self) -> int:
        """Times this pair's sender waited for the receiver to grant a landing slot back."""
        return getattr(self._path, "slot_waits", 0)

    def quiet(self) -> bool:
        """Nothing queued and nothing on the wire."""
        with self._cv:
            return not self._queue and not self._sending

    def enqueue(self, item: Outgoing, front: bool = False) -> bool:
        """Queue `item`; False if the pair no longer accepts messages."""
        with self._cv:
            if not self.accepting:
                return False
            if front:
                self._queue.appendleft(item)
            else:
                self._queue.append(item)
            self.last_used = time.monotonic()
            self._cv.notify()
            return True

    def drop(self, request_id: str) -> None:
        """Forget the queued layers and DONE of one request (its payloads are released)."""
        with self._cv:
            kept = [it for it in self._queue
                    if it.header.rid != request_id or it.header.kind is Kind.ABORT]
            self._queue = deque(kept)

    def close(self, reason: str) -> None:
        """Close cleanly: queued aborts still go out, other queued messages are dropped, the
        receiver is told, threads end."""
        with self._cv:
            if not self.accepting:
                return
            self._state = PairState.CLOSING
            self._close_reason = reason
            self._queue = deque(it for it in self._queue if it.header.kind is Kind.ABORT)
            self._cv.notify()

    def abort(self, reason: str) -> None:
        """Tear the pair down now, without the close handshake (unblocks both threads)."""
        self._down(PairState.BROKEN, reason)

    def join(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for thread in (self._sender, self._reader):
            if thread.is_alive():
                thread.join(max(0.0, deadline - time.monotonic()))

    # ---- send thread -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            channel = self._connect()
        except Exception as exc:  # any rendezvous failure ends the pair, never the process
            self._down(PairState.BROKEN, f"cannot open a pair to {self.address}: {exc}")
            return
        with self._cv:
            self._channel = channel
            aborted = self._state in (PairState.CLOSED, PairState.BROKEN)
            if self._state is PairState.CONNECTING:
                self._state = PairState.OPEN
        if aborted:  # torn down while the rendezvous was running
            self._path.close()  # the NIXL path made since lets go of the receiver's agent
            channel.abort()
            return
        self._reader.start()
        try:
            while (run := self._next()) is not None:
                self._send(run)
            if self._state is PairState.CLOSING:
                self._goodbye()
        except (ChannelClosed, ProtocolError) as exc:
            self._down(PairState.BROKEN, f"pair to {self.address} broke: {exc}")
        except Exception as exc:  # a bug must fail the pair's requests, not strand them
            log.exception("send thread of the pair to %s failed", self.address)
            self._down(PairState.BROKEN, f"pair to {self.address} failed: {exc!r}")

    def _connect(self) -> Channel:
        cfg = self._config
        host, _ = rendezvous.parse_address(self.address)
        self._store = rendezvous.connect(self.address, cfg.connect_timeout_s)
        hello = rendezvous.Hello(
            sender=f"{socket.gethostname()}:{os.getpid()}",
            host=(cfg.host if cfg.host not in ("", "0.0.0.0", "::")
                  else rendezvous.local_host_for(host)),
            transport=self.transport,
            quiet_limit_s=max(cfg.idle_timeout_s, cfg.lease_s) + cfg.io_timeout_s,
        )
        pair_id, reply, keys = rendezvous.offer(self._store, hello, cfg.connect_timeout_s,
                                                cfg.auth_key)
        if not reply.ok:
            raise ConnectionRefusedError(f"receiver refused the pair: {reply.reason}")
        inline = InlineSend(self._cap)
        self._path = inline
        if self._nixl is not None:  # loads the receiving agent: fails here, not mid-request
            agent, pool, staging = self._nixl
            self._path = NixlSend(agent, pool, fallback=inline, cap=self._cap, staging=staging)
        store = rendezvous.pair_store(self._store, pair_id)
        return build_channel(store, SENDER_RANK, hello.host, self.cuda_device, cfg,
                             FrameAuth.for_end(keys, sender=True) if keys else None)

    def _next(self) -> list[Outgoing] | None:
        """The next message to send, or the LAYERs queued at its head (one message's worth:
        the path coalesces them); None when the pair closes."""
        limit = self._path.batch_limit
        with self._cv:
            while not self._queue and self.accepting:
                self._cv.wait()
            if not self._queue:
                return None  # closing (or down) and nothing left to say
            self._sending = True
            run = [self._queue.popleft()]
            blocks = len(run[0].header.blocks)
            while (run[0].header.kind is Kind.LAYER and len(run) < limit and self._queue
                   and self._queue[0].header.kind is Kind.LAYER
                   and blocks + len(self._queue[0].header.blocks) <= MAX_BATCH_BLOCKS):
                blocks += len(self._queue[0].header.blocks)
                run.append(self._queue.popleft())
            return run

    def _send(self, run: list[Outgoing]) -> None:
        try:
            live = [item for item in run if self._listener.on_wire(self, item)]
            timeout = self._config.io_timeout_s
            if live and live[0].header.kind is Kind.LAYER:
                sizes = self._path.send_layers(self._channel, live, timeout)
            elif live:
                sizes = [self._channel.send(FORWARD_TAG, live[0].header, None, timeout)]
            for item, nbytes in zip(live, sizes if live else (), strict=True):
                self._listener.on_sent(self, item, nbytes)
        finally:
            with self._cv:
                self._sending = False
                self.last_used = time.monotonic()

    def _goodbye(self) -> None:
        """Tell the receiver we close, give it a moment to hang up, then close our end."""
        reason = self._close_reason
        try:
            self._channel.send(FORWARD_TAG, Header(Kind.CLOSE, reason=reason), None,
                               self._config.close_timeout_s)
            self._reader.join(self._config.close_timeout_s)  # ends when the receiver hangs up
        except ChannelClosed:
            pass
        self._down(PairState.CLOSED, reason)

    # ---- reader thread -----------------------------------------------------------------------

    def _read(self) -> None:
        try:
            while True:
                header = self._channel.recv_header(BACKWARD_TAG, _NEVER_S)
                if header.kind is Kind.GRANT:
                    self._path.on_grant(header)
                    continue
                if header.kind is not Kind.CLOSE:
                    raise ProtocolError(f"unexpected {header.kind.value!r} from the receiver")
                self.close(f"receiver {self.address} closed the pair: {header.reason}")
        except (ChannelClosed, ProtocolError) as exc:
            if self._state is PairState.OPEN:
                self._down(PairState.BROKEN, f"lost the receiver {self.address}: {exc}")

    # ---- both --------------------------------------------------------------------------------

    def _down(self, state: PairState, reason: str) -> None:
        with self._cv:
            if self._state in (PairState.CLOSED, PairState.BROKEN):
                return
            self._state = state
            self._queue.clear()
            self._cv.notify()
            channel = self._channel
        # clean: the receiver hung up after our CLOSE, so it reads none of our slots now
        clean = state is PairState.CLOSED and not self._reader.is_alive()
        self._path.close(clean)  # wakes a send waiting for a landing slot
        if channel is not None:
            channel.abort()
        self._listener.on_down(self, reason)
