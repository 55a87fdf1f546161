"""A pair's process groups and the framing of messages on them.

A `Channel` is one end of a pair: a 2-rank gloo group for control messages (and CPU payloads)
and, on NCCL pairs, a 2-rank NCCL group for CUDA payloads. Groups are built directly on a
`PrefixStore` of the receiver's TCPStore, never through the global default group, because one
process talks to many peers. The receiver is rank 0, the sender rank 1. Headers from sender to
receiver use `FORWARD_TAG`, their inline payloads `PAYLOAD_TAG`; the receiver's messages back
(slot grants, close requests) use `BACKWARD_TAG`, read by a dedicated thread on the sender that
doubles as its failure detector.

A gloo send completes only once the peer has posted the matching receive (a round trip of
notifications between the two processes' gloo threads). So a header is one frame (its length
inside) received into a buffer of the largest header's size, and each reader keeps the
receive of its next frame posted while it handles the current one (`_FrameReader`): a header
or a GRANT then lands at once, without a round trip; since payloads have their own tag, a
posted header receive never swallows one.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroupGloo

from kv_store.transfer import carrier, wire
from kv_store.transfer.auth import FrameAuth
from kv_store.transfer.config import TransferConfig
from kv_store.transfer.wire import Header, ProtocolError

RECEIVER_RANK = 0
SENDER_RANK = 1
FORWARD_TAG = 0
BACKWARD_TAG = 1
PAYLOAD_TAG = 2  # inline payloads (forward): apart from headers, whose receive stays posted
_ABORT_TAG = 7  # never used by a message: a recv on it exists only to time out (see abort)
_LENGTH_BYTES = 8  # a header frame: little-endian byte count, then the (sealed) header


class ChannelClosed(RuntimeError):
    """The pair's connection is gone (peer died, timed out, or aborted locally)."""


def build_channel(
    store: dist.Store, rank: int, host: str, cuda_device: torch.device | None,
    config: TransferConfig, auth: FrameAuth | None = None,
) -> Channel:
    """Build this end of a pair (blocks until the peer builds its end, or connect_timeout_s).

    `store` is already prefixed for this pair; `host` is the local address gloo listens on;
    `cuda_device` set means an NCCL group for payloads is built too; `auth` seals and opens
    the headers of an authenticated pair.
    """
    opts = ProcessGroupGloo._Options()
    opts._timeout = timedelta(seconds=config.connect_timeout_s)
    opts._threads = 1  # point-to-point ops never use the gloo worker threads
    opts._devices = [ProcessGroupGloo.create_device(hostname=host)]
    gloo = ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, 2, opts)
    nccl = None
    if cuda_device is not None:
        # Our own waits (io_timeout_s) time out first and abort the group; the NCCL
        # watchdog's limit is only a backstop, since by default it tears the process down.
        watchdog_s = config.connect_timeout_s + 2 * config.io_timeout_s
        nccl = _nccl_group(dist.PrefixStore("nccl/", store), rank, watchdog_s)
    return Channel(gloo, rank, nccl, cuda_device, auth)


def _nccl_group(store: dist.Store, rank: int, timeout_s: float) -> dist.ProcessGroup:
    from torch.distributed import ProcessGroupNCCL  # absent from CPU builds of torch

    opts = ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=timeout_s)
    return ProcessGroupNCCL(store, rank, 2, opts)


class Channel:
    """One end of a pair. `send` and `recv_*` may run concurrently on different tags."""

    def __init__(
        self,
        gloo: dist.ProcessGroup,
        rank: int,
        nccl: dist.ProcessGroup | None = None,
        cuda_device: torch.device | None = None,
        auth: FrameAuth | None = None,
    ) -> None:
        self._gloo = gloo
        self._auth = auth
        self._nccl = nccl
        self._peer = 1 - rank
        self._device = cuda_device if nccl is not None else torch.device("cpu")
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()  # seal, post and wait one message at a time
        self._aborted = False
        self._readers: dict[int, _FrameReader] = {}  # by tag; one reading thread per tag
        # a header sent by `post`, not yet waited for (its works hold its frame), and its timeout
        self._posted: tuple[Sequence[dist.Work], float] = ((), 0.0)

    @property
    def device(self) -> torch.device:
        """Where received payloads land and where payloads must be to avoid a staging copy."""
        return self._device

    def send(self, tag: int, header: Header, payload: torch.Tensor | None, timeout_s: float) -> int:
        """Send one message and wait until the backend is done with it; return payload bytes.
        Thread-safe: a receiver's pair thread (slot grants) and its watchdog (close requests)
        both write the backward direction, and sealed frames must go out in sequence order."""
        return sum(self.send_frame(tag, header, () if payload is None else (payload,),
                                   timeout_s))

    def send_frame(self, tag: int, header: Header, payloads: Sequence[torch.Tensor],
                   timeout_s: float) -> list[int]:
        """Send a header and the payloads that follow it (a BATCH's inline parts, in order),
        posted together and waited for once; the bytes of each payload."""
        with self._send_lock, self._closed_on_error(), self._on_device():
            self._settle()
            works = self._post_header(tag, wire.encode_header(header))
            carriers = [carrier.to_carrier(self._staged(p)) for p in payloads]  # alive until sent
            works += [self._group_for(c).send([c], self._peer, PAYLOAD_TAG) for c in carriers]
            for work in works:
                work.wait(timedelta(seconds=timeout_s))
        return [c.numel() * c.element_size() for c in carriers]

    def post(self, tag: int, header: Header, timeout_s: float) -> None:
        """Send a header without a payload, without waiting for the peer to take it: the
        wait (up to `timeout_s`) happens before this end's next send, so a failure surfaces
        there (or in a receive: the peer is gone). A header announcing bytes already in a
        NIXL slot, or a GRANT, need not hold up its thread for a round of wake-ups between
        the two processes (measured ~0.5-0.7 ms each)."""
        with self._send_lock, self._closed_on_error():
            self._settle()
            self._posted = (self._post_header(tag, wire.encode_header(header)), timeout_s)

    def flush(self) -> None:
        """Wait for a posted header to be taken (`ChannelClosed` if it is not in time)."""
        with self._send_lock, self._closed_on_error():
            self._settle()

    def _settle(self) -> None:
        """Wait for the posted header, if any (holding the send lock): frames go out one
        after the other, so at most one is ever outstanding. Its own timeout applies."""
        works, posted_timeout = self._posted
        if works:
            self._posted = ((), 0.0)
            for work in works:
                work.wait(timedelta(seconds=posted_timeout))

    def send_raw_header(self, tag: int, data: bytes, timeout_s: float) -> None:
        """Send already-encoded header bytes (lets tests speak a foreign protocol version)."""
        with self._send_lock, self._closed_on_error():
            self._settle()
            for work in self._post_header(tag, data):
                work.wait(timedelta(seconds=timeout_s))

    def recv_header(self, tag: int, timeout_s: float) -> Header:
        """Wait up to `timeout_s` for the next message's header; `ProtocolError` if foreign.
        One thread per tag."""
        with self._closed_on_error():
            reader = self._readers.get(tag)
            if reader is None:
                reader = self._readers[tag] = _FrameReader(self._gloo, self._peer, tag)
            frame = reader.next(timeout_s)
        return wire.decode_header(self._auth.opener.open(frame) if self._auth else frame)

    def recv_payload(self, header: Header, timeout_s: float) -> torch.Tensor:
        """Receive the inline payload announced by a LAYER header, in the header's dtype."""
        with self._closed_on_error(), self._on_device():
            buf = carrier.empty_carrier(header.shape, header.dtype, self._device)
            self._group_for(buf).recv([buf], self._peer, PAYLOAD_TAG).wait(
                timedelta(seconds=timeout_s))
        return carrier.from_carrier(buf, header.dtype)

    def abort(self) -> None:
        """Close the pair now: every pending op on either end fails at once. Idempotent."""
        with self._lock:
            if self._aborted:
                return
            self._aborted = True
        # gloo cannot cancel another thread's pending op, but an op whose wait times out closes
        # the connection, which fails every pending op on this pair and tells the peer.
        try:
            probe = torch.empty(1, dtype=torch.uint8)
            self._gloo.recv([probe], self._peer, _ABORT_TAG).wait(timedelta(milliseconds=1))
        except RuntimeError:
            pass
        if self._nccl is not None:
            try:
                self._nccl.abort()
            except RuntimeError:
                pass

    def _post_header(self, tag: int, data: bytes) -> list[dist.Work]:
        if self._auth is not None:
            data = self._auth.sealer.seal(data)
        if len(data) > wire.MAX_HEADER_BYTES:
            raise ValueError(f"header of {len(data)} bytes exceeds {wire.MAX_HEADER_BYTES}")
        frame = torch.frombuffer(bytearray(len(data).to_bytes(_LENGTH_BYTES, "little") + data),
                                 dtype=torch.uint8)
        return [self._gloo.send([frame], self._peer, tag)]

    def _staged(self, payload: torch.Tensor) -> torch.Tensor:
        if payload.is_cuda and self._nccl is None:
            return payload.cpu()  # gloo pair: stage CUDA tensors through host memory
        if not payload.is_cuda and self._nccl is not None:
            return payload.to(self._device)
        return payload

    def _group_for(self, tensor: torch.Tensor) -> dist.ProcessGroup:
        return self._nccl if tensor.is_cuda and self._nccl is not None else self._gloo

    def _on_device(self) -> contextlib.AbstractContextManager:
        # NCCL picks its communicator from the calling thread's current device
        if self._device.type == "cuda":
            return torch.cuda.device(self._device)
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def _closed_on_error(self) -> Iterator[None]:
        try:
            yield
        except (ProtocolError, ChannelClosed):
            raise
        except RuntimeError as exc:  # gloo/NCCL report a dead or timed-out pair this way
            raise ChannelClosed(_first_line(exc)) from exc


class _FrameReader:
    """Header frames of one tag, the next one's receive always posted (see the module
    docstring). Two buffers take turns: one is parsed while the other is being filled."""

    def __init__(self, gloo: dist.ProcessGroup, peer: int, tag: int) -> None:
        self._gloo, self._peer, self._tag = gloo, peer, tag
        size = _LENGTH_BYTES + wire.MAX_HEADER_BYTES  # untouched pages are never resident
        self._buffers = [torch.empty(size, dtype=torch.uint8) for _ in range(2)]
        self._turn = 0
        self._work = self._post()

    def _post(self) -> dist.Work:
        return self._gloo.recv([self._buffers[self._turn]], self._peer, self._tag)

    def next(self, timeout_s: float) -> bytes:
        """The next frame's header bytes (copied out)."""
        self._work.wait(timedelta(seconds=timeout_s))
        buf = self._buffers[self._turn]
        self._turn ^= 1
        self._work = self._post()  # before parsing: the next frame may land meanwhile
        # A frame shorter than its length would leave an older frame's bytes behind: on an
        # authenticated pair they fail the sequence-numbered MAC (an open pair trusts its
        # sender anyway).
        n = int.from_bytes(buf[:_LENGTH_BYTES].numpy().tobytes(), "little")
        if not 0 < n <= wire.MAX_HEADER_BYTES:
            raise ProtocolError(f"header length {n} out of range (1..{wire.MAX_HEADER_BYTES})")
        return buf[_LENGTH_BYTES:_LENGTH_BYTES + n].numpy().tobytes()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]
