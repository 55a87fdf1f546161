"""The NIXL payload path: senders write KV bytes into the receiver's landing pool.

A receiver with a NIXL agent registers one landing pool once (`LandingPool`: slots of
`nixl_slot_bytes`) and offers it in its `NixlDescriptor` — the agent's metadata, the pool's
address and slot layout — which the decode worker hands out only over the authenticated gRPC
hand-off (`KVEndpoint.nixl`). A sender that has the descriptor opens a pair whose hello names
transport "nixl"; the control frames stay on the pair (sealed, ticket-tagged, ordered), only
the bytes move through NIXL:

    receiver: pair open ─► GRANT{its slots, in ring order; its credit counter} (once)
    sender, per message of k parts (a part: whole blocks of one LAYER, at most a slot;
      k from `coalesce`: what is ready, at most half the pair's slots):
      the next k slots of the ring, once the credit counter says they were copied out
        (a NIXL READ of 16 bytes: no message, no wake-up; polled while the sender waits)
      ─► one NIXL WRITE of the k parts ─► slots  (CMA on one host, RDMA across)
      ─► LAYER{..., slot}, or BATCH{k of them} (sealed, each part tagged; posted, not
         waited for: the next write overlaps its delivery) ─► receiver:
         per part: checks it names the next slot of the ring, its ticket and reservation,
         copies slot ─► paged cache (the sink, under its lock); then counter += k

The counter (`LandingPool.credit`: a count and its complement, so a torn read is noticed;
it never goes back or past what was written) replaced a GRANT message per message (wire
version 8): posting that GRANT took the receiver 0.3-3.6 ms of wake-ups per message on two
shared cores, on its critical path (`docs/perf.md`).

Why a landing pool and not the paged cache itself: a one-sided write into the cache could
land in a block after the decode worker freed it (a cancelled request, its writer not yet
told) and corrupt the next owner's KV; bytes land in slots that only this pair may write, and
the receiver moves them into the cache only after the header passed every check, under the
same lock that orders writes against cancellation (`decode_worker.kv_sink`). The price is
one copy on the receiver, which the gloo path pays too.

A slot is the sender's to write from the moment the counter covers its last use until the
receiver sees the LAYER naming it; a pair whose sender never got slots (the pool is used up)
sends its payloads inline. Slots of a pair that broke are quarantined before reuse (a write
of its sender may still land within its write timeout), and with them its counter (which
sits at its first slot's line); the pool's memory outlives the receiver by the same bound.

A sender on the receiver's host has the receiver read instead (`nixl_read`: an OFFER of its
own staging pool, whose slots the receiver reads straight into its cache: one copy); the
granted window and the credit counter pace it as before, and the receiver's slots then only
serve as bounce buffers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack
import torch

from kv_store.transfer import auth, carrier, wire
from kv_store.transfer.channel import BACKWARD_TAG, FORWARD_TAG, Channel, ChannelClosed
from kv_store.transfer.coalesce import parts_per_message
from kv_store.transfer.nixl_agent import NixlAgent, NixlWriteError, Registration, RemoteRead
from kv_store.transfer.nixl_read import LocalRegions, ReadSource, RemoteKV
from kv_store.transfer.wire import Header, Kind, ProtocolError
from pdserve.engine.huge_pages import huge_page_buffer

if TYPE_CHECKING:
    from kv_store.transfer.sender_pair import Outgoing

DESCRIPTOR_VERSION = 1
# Descriptor version history: 1 — agent metadata, pool base address, slot size and count,
# memory kind and device.
MAX_METADATA_BYTES = 1 << 20
CREDIT_BYTES = 64  # one cache line per pair's credit counter
_POLL_MAX_S = 0.0002  # longest pause between two reads of the credit counter


@dataclass(frozen=True)
class NixlDescriptor:
    """What a sender needs to write into a receiver's landing pool."""

    metadata: bytes
    """The receiving agent's NIXL metadata (connection info and registration keys)."""
    base: int
    """Address of slot 0 in the receiver's process."""
    slot_bytes: int
    num_slots: int
    mem: str = "DRAM"
    """"DRAM" (a CPU pool) or "VRAM" (a CUDA pool)."""
    device: int = 0

    def encode(self) -> bytes:
        return msgpack.packb({"v": DESCRIPTOR_VERSION, "md": self.metadata, "base": self.base,
                              "slot_bytes": self.slot_bytes, "slots": self.num_slots,
                              "mem": self.mem, "dev": self.device}, use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes) -> NixlDescriptor:
        """`ValueError` naming the field unless `data` is a descriptor of this version."""
        try:
            doc = msgpack.unpackb(data, raw=False)
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
            raise ValueError("NIXL descriptor is not msgpack") from None
        version = doc.get("v") if isinstance(doc, dict) else None
        if version != DESCRIPTOR_VERSION:
            raise ValueError(f"NIXL descriptor version {version!r} is not {DESCRIPTOR_VERSION}")
        md = doc.get("md")
        if not isinstance(md, bytes) or not 0 < len(md) <= MAX_METADATA_BYTES:
            raise ValueError("NIXL descriptor field 'md' must be non-empty bytes")
        ints = {k: doc.get(k) for k in ("base", "slot_bytes", "slots", "dev")}
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                   for v in ints.values()) or not ints["slot_bytes"] or not ints["slots"]:
            raise ValueError("NIXL descriptor fields 'base', 'slot_bytes', 'slots', 'dev' "
                             "must be non-negative ints (slots and their size positive)")
        if doc.get("mem") not in ("DRAM", "VRAM"):
            raise ValueError("NIXL descriptor field 'mem' must be DRAM or VRAM")
        return cls(md, ints["base"], ints["slot_bytes"], ints["slots"], doc["mem"], ints["dev"])

    def accepts(self, payload: torch.Tensor) -> bool:
        """Whether payloads on this tensor's device can be written into the pool."""
        return payload.is_cuda == (self.mem == "VRAM")

    def slot_address(self, slot: int) -> int:
        if not 0 <= slot < self.num_slots:
            raise ProtocolError(f"slot {slot} is outside the pool's {self.num_slots}")
        return self.base + slot * self.slot_bytes

    def check_credit(self, address: int) -> None:
        """`ProtocolError` unless `address` is a credit line of the pool (see `LandingPool`)."""
        first = self.base + self.num_slots * self.slot_bytes
        if not (first <= address < first + self.num_slots * CREDIT_BYTES
                and (address - first) % CREDIT_BYTES == 0):
            raise ProtocolError("GRANT names a credit counter outside the receiver's pool")


class LandingPool:
    """A receiver's registered landing memory, cut into slots; thread-safe. A sender's
    staging pool (`nixl_read`) is the same kind of memory."""

    def __init__(self, agent: NixlAgent, nbytes: int, slot_bytes: int,
                 device: torch.device | None = None, quarantine_s: float = 30.0) -> None:
        self.agent = agent  # registers the pool; a reading pair loads its sender here
        self.slot_bytes = slot_bytes
        self.num_slots = nbytes // slot_bytes
        # the slots, then one credit line per slot (a pair's counter sits at its first slot's)
        nbytes = self.num_slots * (slot_bytes + CREDIT_BYTES)
        self._region: mmap.mmap | None = None  # a host pool's mapping (what `lend` cuts)
        if device is not None and device.type != "cpu":
            self._buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        else:
            # huge pages: a CMA copy runs at the pace of the other process's pages
            host = huge_page_buffer(nbytes)
            self._buffer, self._region, self._start = host.tensor, host.region, host.start
        self._reg: Registration | None = agent.register(self._buffer)
        dev = self._buffer.get_device() if self._buffer.is_cuda else 0
        self.descriptor = NixlDescriptor(agent.metadata(), self._buffer.data_ptr(), slot_bytes,
                                         self.num_slots, self._reg.mem, dev)
        self._quarantine_s = quarantine_s
        self._lock = threading.RLock()  # a lent slot may come back while it is held
        self._free: deque[int] = deque(range(self.num_slots))
        self._held: list[tuple[float, list[int]]] = []  # (free again at, slots)
        self._kept: list[tuple[float, list[torch.Tensor]]] = []  # (dropped at, lent slots)
        self._holders: weakref.WeakSet = weakref.WeakSet()  # pairs holding lent slots

    def take(self, want: int) -> list[int]:
        """Up to `want` free slots (fewer, or none, when the pool runs low)."""
        with self._lock:
            self._reclaim(time.monotonic())
            return [self._free.popleft() for _ in range(min(want, len(self._free)))]

    def lend(self, nbytes: int) -> torch.Tensor | None:
        """A free slot's first `nbytes`, as a uint8 tensor of its own that returns the slot
        to the pool once it and every view of it are gone (None: no free slot, `nbytes` does
        not fit one, or the pool is not in host memory). A sender's staging slots are lent:
        whoever holds the payload holds its slot, whatever path drops it."""
        if self._region is None or not 0 < nbytes <= self.slot_bytes:
            return None
        slots = self.take(1)
        if not slots:  # pairs may hold slots their receivers have read by now
            for holder in list(self._holders):
                holder.let_go()
            slots = self.take(1)
        if not slots:
            return None
        at = self._start + slots[0] * self.slot_bytes
        view = memoryview(self._region)[at:at + nbytes]
        lent = torch.frombuffer(view, dtype=torch.uint8)
        weakref.finalize(view, self.give_back, slots, False)  # when the storage is freed
        return lent

    def held_by(self, holder: Any) -> None:
        """`holder.let_go()` returns lent slots it no longer needs; asked when none is free."""
        self._holders.add(holder)

    def keep(self, lent: list[torch.Tensor]) -> None:
        """Hold lent slots for the quarantine (a reader may still be under way), then let
        them go back."""
        with self._lock:
            self._kept.append((time.monotonic() + self._quarantine_s, list(lent)))

    def slot_of(self, tensor: torch.Tensor) -> int | None:
        """The slot `tensor`'s bytes start and fit in, if they lie in this pool."""
        if tensor.is_cuda != self._buffer.is_cuda:
            return None
        at = tensor.data_ptr() - self._buffer.data_ptr()
        slot, offset = divmod(at, self.slot_bytes)
        nbytes = tensor.numel() * tensor.element_size()
        if not 0 <= slot < self.num_slots or offset or nbytes > self.slot_bytes:
            return None
        return slot

    def give_back(self, slots: list[int], quarantined: bool) -> None:
        """Return a pair's slots; `quarantined`: its sender may still write into them."""
        with self._lock:
            if quarantined:
                self._held.append((time.monotonic() + self._quarantine_s, list(slots)))
            else:
                self._free.extend(slots)

    @property
    def num_free(self) -> int:
        with self._lock:
            self._reclaim(time.monotonic())
            return len(self._free)

    def credit(self, slot: int) -> tuple[torch.Tensor, int]:
        """The credit counter of the pair whose first slot is `slot` (int64[2]: the count and
        its complement, so a torn remote read is seen as one), and its address."""
        start = self.num_slots * self.slot_bytes + slot * CREDIT_BYTES
        return self._buffer[start:start + 16].view(torch.int64), self._buffer.data_ptr() + start

    def view(self, slot: int, nbytes: int) -> torch.Tensor:
        """The first `nbytes` of a slot (a view of the pool: no copy)."""
        start = slot * self.slot_bytes
        return self._buffer[start:start + nbytes]

    def close(self) -> None:
        """Deregister; the memory itself is kept for the quarantine, in case a sender's
        write is still under way."""
        if self._reg is None:
            return
        self.agent.deregister(self._reg)
        self._reg = None
        keep = threading.Timer(self._quarantine_s, lambda buf=self._buffer: None)
        keep.daemon = True
        keep.start()

    def _reclaim(self, now: float) -> None:
        ready = [slots for until, slots in self._held if until <= now]
        self._held = [(until, slots) for until, slots in self._held if until > now]
        for slots in ready:
            self._free.extend(slots)
        self._kept = [(until, lent) for until, lent in self._kept if until > now]


class NixlSend:
    """Sender end: writes each LAYER's blocks into granted slots, then sends its header."""

    transport = "nixl"

    def __init__(self, agent: NixlAgent, peer: NixlDescriptor, fallback: Any,
                 cap: int = 1, staging: LandingPool | None = None) -> None:
        """`cap`: `TransferConfig.coalesce_max_parts`; `staging`: this process's staging
        pool, for a receiver on this host (the pair OFFERs it: `nixl_read`)."""
        self._agent = agent
        self._peer = peer
        self._peer_name = agent.connect(peer.metadata)  # until close() disconnects
        self._connected = True
        self._fallback = fallback  # inline path, for payloads that cannot use a slot
        self._cap = cap
        self.slot_waits = 0
        """Times a message waited for the receiver to release a slot (backpressure)."""
        self._cv = threading.Condition()
        self._ring: tuple[int, ...] = ()  # the pair's slots, in the order they are written
        self._owned = 0
        self._written = 0  # slot parts written so far (the next goes to ring[written % owned])
        self._released = 0  # of which the receiver has copied out (its credit counter)
        self._credit = torch.zeros(2, dtype=torch.int64)  # where the counter is read into
        self._credit_reg: Registration | None = None
        self._read: RemoteRead | None = None
        self._granted = False  # the receiver's GRANT arrived
        self._closed = False
        self._peer_gone = False  # a transfer to the receiver's agent failed: close() asks nothing
        self._staging = staging
        self._offered = False  # an OFFER was tried (once, before the first slot part)
        self.reading = False
        """The receiver reads this pair's parts from staging slots (`nixl_read`)."""
        # parts sent but maybe not read yet: (parts written once it is sent, its lent slot)
        self._unread: deque[tuple[int, torch.Tensor]] = deque()
        self._credit_lock = threading.Lock()  # the counter is also read for `let_go`

    @property
    def batch_limit(self) -> int:
        return parts_per_message(self._cap, self._cap, self._owned or None)

    def on_grant(self, header: Header) -> None:
        """The pair's one GRANT: its slots and where the receiver counts their release."""
        if self._granted:
            raise ProtocolError("a second GRANT on the pair")
        bad = [s for s in header.slots if not 0 <= s < self._peer.num_slots]
        if bad or len(set(header.slots)) != len(header.slots):
            raise ProtocolError(f"GRANT names slots outside the receiver's pool, or twice: "
                                f"{header.slots[:8]}")
        reg = read = None
        if header.slots:
            self._peer.check_credit(header.credit)
            reg = self._agent.register(self._credit)
            try:
                read = self._agent.reader(self._peer_name, (self._credit.data_ptr(), 16),
                                          (header.credit, 16), self._peer.mem,
                                          self._peer.device)
            except NixlWriteError as exc:
                self._agent.deregister(reg)
                raise ChannelClosed(str(exc)) from None
        with self._cv:
            self._ring, self._owned = header.slots, len(header.slots)
            self._granted = True
            self._credit_reg, self._read = reg, read
            self._cv.notify_all()
            if not self._closed:
                return
        self.close()  # torn down meanwhile: release what close() could not see

    def close(self, clean: bool = False) -> None:
        """`clean`: the receiver hung up after the close handshake (it reads no more).
        Unclean, the credit counter is read once more, so that parts the receiver has read
        free their staging slots at once; the rest go to the quarantine. Not once a transfer
        to its agent has failed: a read posted to an agent that is gone fails too, and UCX
        never returns that request to its pool (a warning at exit). A receiver that dies
        while this side is idle is still read once (a broken channel does not tell a dead
        receiver from one that aborted the pair and still reads)."""
        with self._cv:
            self._closed = True
            read, reg, self._credit_reg = self._read, self._credit_reg, None
            connected, self._connected = self._connected, False
            self._cv.notify_all()
        if read is not None and self._unread and not (clean or self._peer_gone):
            # what the receiver has read by now is free at once; only the rest waits
            with contextlib.suppress(ChannelClosed, ProtocolError):
                self._read_credit(time.monotonic() + 0.5)
        with self._credit_lock:
            unread, self._unread = [lent for _, lent in self._unread], deque()
        if read is not None:  # waits for a read under way; later ones fail
            read.release()
        if reg is not None:
            self._agent.deregister(reg)
        if unread and not clean:  # the receiver may still be reading them
            self._staging.keep(unread)
        if connected:  # the last pair to a receiver unloads its agent
            self._agent.disconnect(self._peer.metadata)

    def send_layers(self, channel: Channel, items: Sequence[Outgoing],
                    timeout_s: float) -> list[int]:
        """Write the items' blocks into granted slots, as few messages as `coalesce` allows;
        an item that cannot use a slot goes inline, in its place in the order."""
        sizes: list[int] = []
        parts: list[_Part] = []
        regs: list[Registration] = []
        try:
            granted = self._wait_granted(time.monotonic() + timeout_s)
            if granted and self._staging is not None and not self._offered:
                self._offer(channel, timeout_s)
            limit = (min(self._peer.slot_bytes, self._staging.slot_bytes) if self.reading
                     else self._peer.slot_bytes)
            for item in items:
                payload = carrier.to_carrier(item.payload)
                nbytes = payload.numel() * payload.element_size()
                per_block = nbytes // max(len(item.header.blocks), 1)
                split = (_split(item, payload, per_block, limit)
                         if granted and 0 < per_block <= limit and self._peer.accepts(payload)
                         else None)
                if split is not None and self.reading:
                    split = self._stage(split, timeout_s)
                if split is None:
                    self._flush(channel, parts, timeout_s)  # what precedes it goes first
                    self._fallback.send_layers(channel, [item], timeout_s)
                else:
                    if item.ready is not None:
                        item.ready.synchronize()  # a CUDA payload: NIXL copies outside streams
                    if not self.reading:  # a read comes from the staging pool instead
                        regs.append(self._agent.register(payload))
                    parts += split
                sizes.append(nbytes)
            self._flush(channel, parts, timeout_s)
        finally:
            for reg in regs:
                self._agent.deregister(reg)
        return sizes

    def _offer(self, channel: Channel, timeout_s: float) -> None:
        """Offer the receiver the staging pool to read from (once, before any slot part);
        the receiver's granted slots still set the window."""
        self._offered = True
        channel.send(FORWARD_TAG, Header(Kind.OFFER, body=self._staging.descriptor.encode()),
                     None, timeout_s)
        self.reading = True
        self._staging.held_by(self)

    def _stage(self, parts: list[_Part], timeout_s: float) -> list[_Part] | None:
        """The parts in staging slots: as they are when the payload was gathered into one
        (`KVSender.stage`), else each copied into a slot lent now (waiting for the receiver
        to read parts of ours when the pool is out of slots); None (send inline) for a
        device payload, or when the pool has no slot free and we hold none."""
        if len(parts) == 1 and parts[0].src == parts[0].payload.data_ptr() \
                and self._staging.slot_of(parts[0].payload) is not None:
            return parts
        if parts[0].payload.is_cuda:
            return None
        staged = []
        for p in parts:
            lent = self._staging.lend(p.nbytes)
            if lent is None and self._unread:  # ours come back as the receiver reads them
                self._await_credit(self._unread[0][0], time.monotonic() + timeout_s)
                lent = self._staging.lend(p.nbytes)
            if lent is None:
                return None
            lent.copy_(p.data())
            staged.append(_Part(p.header, lent, lent.data_ptr(), p.nbytes))
        return staged

    def _flush(self, channel: Channel, parts: list[_Part], timeout_s: float) -> None:
        """Send `parts` (emptying it): per message, one NIXL write of its slots (or, on a
        reading pair, a copy into its staging slots), then its header (a LAYER, or a BATCH
        of them)."""
        while parts:
            deadline = time.monotonic() + timeout_s
            slots = self._take(len(parts), deadline)
            run, parts[:] = parts[:len(slots)], parts[len(slots):]
            dev = run[0].payload.get_device() if run[0].payload.is_cuda else 0
            if self.reading:  # the parts wait in staging slots, for the receiver to read
                slots = [self._staging.slot_of(p.payload) for p in run]
                with self._credit_lock:
                    self._unread.extend((self._written, p.payload) for p in run)
            else:
                self._write(run, slots, dev, deadline)
            header = wire.batch(tuple(dataclasses.replace(p.header, slot=s)
                                      for p, s in zip(run, slots, strict=True)))
            # not waited for here: the next message's write overlaps its delivery
            channel.post(FORWARD_TAG, header, max(deadline - time.monotonic(), 0.001))

    def _write(self, run: list[_Part], slots: list[int], dev: int, deadline: float) -> None:
        try:
            self._agent.write(self._peer_name, self._peer.mem, dev,
                              [(p.src, p.nbytes) for p in run],
                              [(self._peer.slot_address(s), p.nbytes)
                               for p, s in zip(run, slots, strict=True)],
                              max(deadline - time.monotonic(), 0.001))
        except NixlWriteError as exc:
            self._peer_gone = True
            raise ChannelClosed(str(exc)) from None

    def _wait_granted(self, deadline: float) -> bool:
        """Whether this pair owns slots (waits for the receiver's first GRANT)."""
        with self._cv:
            self._wait(lambda: self._granted, deadline, "granted no landing slots")
            return self._owned > 0

    def _take(self, ready: int, deadline: float) -> list[int]:
        """Slots for the next message of `ready` parts, the next ones of the ring (waits for
        the receiver to release them when they are not: backpressure)."""
        n = parts_per_message(ready, self._cap, self._owned)
        if self._written + n - self._released > self._owned:
            self.slot_waits += 1
            self._await_credit(self._written + n - self._owned, deadline)
        slots = [self._ring[(self._written + i) % self._owned] for i in range(n)]
        self._written += n
        return slots

    def let_go(self) -> None:
        """Drop the parts the receiver has read by now, so their staging slots go back to
        the pool (any thread: the pool asks when it runs out; a failed read is left to the
        pair's own thread to notice)."""
        if self._unread and not self._closed:
            with contextlib.suppress(ChannelClosed, ProtocolError):
                self._read_credit(time.monotonic() + 1.0)

    def _await_credit(self, target: int, deadline: float) -> None:
        """Read the receiver's credit counter until it has released `target` parts; short
        pauses between reads (each ~2 us) so a wait costs the cores next to nothing."""
        pause = 0.0
        while True:
            if self._closed:
                raise ChannelClosed("pair closed")
            if self._read_credit(deadline) >= target:
                return
            if time.monotonic() >= deadline:
                raise ChannelClosed("the receiver released no landing slot in time")
            pause = min(_POLL_MAX_S, pause * 2 or 0.00002)
            time.sleep(pause)

    def _read_credit(self, deadline: float) -> int:
        """Read the counter once: the parts released (as known, if the read was torn); lets
        go of the staging slots of the parts read."""
        with self._credit_lock:
            try:
                self._read.read(max(deadline - time.monotonic(), 0.001))
            except NixlWriteError as exc:
                self._peer_gone = True
                raise ChannelClosed(str(exc)) from None
            count, check = self._credit.tolist()
            # a torn read (count and complement from different updates) is read again; a
            # count that goes back or past what was written is the receiver's bug or worse
            if count == ~check:
                if not self._released <= count <= self._written:
                    raise ProtocolError(f"credit counter says {count} parts released, of "
                                        f"{self._written} written ({self._released} before)")
                self._released = count
            while self._unread and self._unread[0][0] <= self._released:
                self._unread.popleft()  # read: its slot goes back once nothing holds it
            return self._released

    def _wait(self, ready, deadline: float, what: str) -> None:
        """Wait (holding the condition) until `ready()`; `ChannelClosed` at the deadline or
        when the pair closes."""
        while not ready() and not self._closed:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChannelClosed(f"the receiver {what} in time")
            self._cv.wait(left)
        if self._closed:
            raise ChannelClosed("pair closed")


class NixlReceive:
    """Receiver end: owns some of the pool's slots, hands them out and takes them back; or,
    once the sender OFFERs its staging slots, reads the parts from them (`nixl_read`)."""

    transport = "nixl"

    def __init__(self, pool: LandingPool | None, want: int, fallback: Any,
                 regions: LocalRegions | None = None, read_timeout_s: float = 30.0) -> None:
        """`regions`: memory the sink lands payloads in, registered (reads go straight
        there); `read_timeout_s`: the longest a read from the sender may take."""
        self._pool = pool
        self._regions = regions
        self._read_timeout_s = read_timeout_s
        self._source: ReadSource | None = None  # set by the sender's OFFER
        self._staging: NixlDescriptor | None = None
        self._slots = pool.take(want) if pool is not None else []
        self._received = 0  # slot parts received (the next must name ring[received % n])
        self._released = 0  # of which copied out: published in the credit counter
        self._credit, self._credit_address = (pool.credit(self._slots[0]) if self._slots
                                              else (None, -1))
        self._publish(0)  # the line may hold a count of an earlier pair's
        self._fallback = fallback

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    @property
    def reading(self) -> bool:
        """The sender OFFERed its staging pool: parts are read from it."""
        return self._source is not None

    def start(self, channel: Channel, timeout_s: float) -> None:
        channel.send(BACKWARD_TAG, Header(Kind.GRANT, slots=tuple(self._slots),
                                          credit=self._credit_address), None, timeout_s)

    def on_offer(self, header: Header) -> None:
        """The sender's staging slots: from now on each slot part is read from them."""
        if self._source is not None or self._received:
            raise ProtocolError("an OFFER after the pair's first slot part, or a second one")
        if not self._slots:
            raise ProtocolError("an OFFER on a pair granted no landing slots")
        try:
            staging = NixlDescriptor.decode(header.body)
        except ValueError as exc:
            raise ProtocolError(f"OFFER: {exc}") from None
        if staging.mem != "DRAM":
            raise ProtocolError("OFFER of a staging pool outside host memory")
        try:
            peer = self._pool.agent.connect(staging.metadata)
        except Exception as exc:  # NIXL refuses the metadata
            raise ProtocolError(f"OFFER names an agent NIXL cannot load: {exc}") from None
        self._staging = staging
        self._source = ReadSource(self._pool.agent, peer, (staging.mem, staging.device),
                                  self._regions, self._read_timeout_s)

    def payload(self, channel: Channel, header: Header, timeout_s: float
                ) -> torch.Tensor | RemoteKV:
        if header.slot < 0:
            return self._fallback.payload(channel, header, timeout_s)
        if self._source is not None:
            return self._remote(header)
        n = len(self._slots)
        if not n or header.slot != self._slots[self._received % n] \
                or self._received - self._released >= n:
            raise ProtocolError(f"LAYER names slot {header.slot}, which is not the next one "
                                "this pair's sender may have written")
        nbytes = wire.payload_nbytes(header.shape, header.dtype)
        if nbytes > self._pool.slot_bytes:
            raise ProtocolError(f"LAYER of {nbytes} bytes does not fit a slot")
        self._received += 1
        return carrier.carrier_view(self._pool.view(header.slot, nbytes), header.shape,
                                 header.dtype)

    def _remote(self, header: Header) -> RemoteKV:
        """A part to read from the sender's staging slot `header.slot` (its own memory: which
        slot is its business; the window of parts not yet released is ours)."""
        if header.slot >= self._staging.num_slots \
                or self._received - self._released >= len(self._slots):
            raise ProtocolError(f"LAYER names staging slot {header.slot} of "
                                f"{self._staging.num_slots}, or more parts than the window")
        nbytes = wire.payload_nbytes(header.shape, header.dtype)
        if nbytes > min(self._staging.slot_bytes, self._pool.slot_bytes):
            raise ProtocolError(f"LAYER of {nbytes} bytes does not fit a slot")
        # parts not yet released <= our slots: each has a bounce slot of its own
        bounce = self._pool.view(self._slots[self._received % len(self._slots)],
                                 self._pool.slot_bytes)
        self._received += 1
        return RemoteKV(header.shape, header.dtype, self._source,
                        self._staging.slot_address(header.slot), bounce)

    def release(self, channel: Channel, parts: Sequence[Header], timeout_s: float) -> None:
        done = sum(1 for p in parts if p.slot >= 0)
        if done:  # the handler copied them out: the sender may write them again
            self._released += done
            self._publish(self._released)

    def close(self, clean: bool) -> None:
        if self._pool is not None and self._slots:
            self._pool.give_back(self._slots, quarantined=not clean)
            self._slots = []
        staging, self._staging = self._staging, None
        if staging is not None:  # its reads are done: they run in the pair's thread
            self._source = None
            self._pool.agent.disconnect(staging.metadata)

    def _publish(self, count: int) -> None:
        """Set the credit counter (the complement first: a reader that sees the two from
        different updates reads again)."""
        if self._credit is None:
            return
        if self._credit.is_cuda:  # the copies out of the slots must be done first
            torch.cuda.current_stream(self._credit.device).synchronize()
        self._credit[1] = ~count
        self._credit[0] = count


@dataclass(frozen=True)
class _Part:
    """Whole blocks of one LAYER that fit a slot: its header and where its bytes are."""

    header: Header
    payload: torch.Tensor  # the registered carrier (kept alive until written)
    src: int
    nbytes: int

    def data(self) -> torch.Tensor:
        """The part's bytes (a uint8 view of the payload)."""
        at = self.src - self.payload.data_ptr()
        return self.payload.reshape(-1).view(torch.uint8)[at:at + self.nbytes]


def _split(item: Outgoing, payload: torch.Tensor, per_block: int, slot_bytes: int
           ) -> list[_Part]:
    """The item's blocks in parts of at most one slot (the header as is when one is enough;
    each part tagged again under the transfer's ticket otherwise)."""
    header, n = item.header, len(item.header.blocks)
    step = slot_bytes // per_block
    base = payload.data_ptr()
    return [_Part(header if (a, b) == (0, n) else _part(header, item.ticket, a, b), payload,
                  base + a * per_block, (b - a) * per_block)
            for a in range(0, n, step) for b in (min(n, a + step),)]


def _part(header: Header, ticket: bytes, a: int, b: int) -> Header:
    """Blocks [a, b) of a LAYER header, tagged again under the transfer's ticket."""
    part = dataclasses.replace(header, blocks=header.blocks[a:b],
                               shape=(b - a, *header.shape[1:]), tag=b"")
    return auth.tagged(part, ticket)
