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
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import threading
import time
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
from kv_store.transfer.wire import Header, Kind, ProtocolError

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
    """A receiver's registered landing memory, cut into slots; thread-safe."""

    def __init__(self, agent: NixlAgent, nbytes: int, slot_bytes: int,
                 device: torch.device | None = None, quarantine_s: float = 30.0) -> None:
        self._agent = agent
        self.slot_bytes = slot_bytes
        self.num_slots = nbytes // slot_bytes
        # the slots, then one credit line per slot (a pair's counter sits at its first slot's)
        nbytes = self.num_slots * (slot_bytes + CREDIT_BYTES)
        self._buffer = (torch.zeros(nbytes, dtype=torch.uint8, device=device)
                        if device is not None and device.type != "cpu" else _huge_pages(nbytes))
        self._reg: Registration | None = agent.register(self._buffer)
        dev = self._buffer.get_device() if self._buffer.is_cuda else 0
        self.descriptor = NixlDescriptor(agent.metadata(), self._buffer.data_ptr(), slot_bytes,
                                         self.num_slots, self._reg.mem, dev)
        self._quarantine_s = quarantine_s
        self._lock = threading.Lock()
        self._free: deque[int] = deque(range(self.num_slots))
        self._held: list[tuple[float, list[int]]] = []  # (free again at, slots)

    def take(self, want: int) -> list[int]:
        """Up to `want` free slots (fewer, or none, when the pool runs low)."""
        with self._lock:
            self._reclaim(time.monotonic())
            return [self._free.popleft() for _ in range(min(want, len(self._free)))]

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
        self._agent.deregister(self._reg)
        self._reg = None
        keep = threading.Timer(self._quarantine_s, lambda buf=self._buffer: None)
        keep.daemon = True
        keep.start()

    def _reclaim(self, now: float) -> None:
        ready = [slots for until, slots in self._held if until <= now]
        self._held = [(until, slots) for until, slots in self._held if until > now]
        for slots in ready:
            self._free.extend(slots)


_HUGE_PAGE = 2 << 20


def _huge_pages(nbytes: int) -> torch.Tensor:
    """A zeroed CPU buffer on transparent huge pages where the kernel grants them: a CMA
    write pins every destination page, and 2 MiB pages made a 3 MiB write ~25% faster
    (measured, `docs/perf.md`). The tensor keeps its mapping alive; plain pages otherwise."""
    region = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(region, dtype=torch.uint8)
    start = -whole.data_ptr() % _HUGE_PAGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # no THP in this kernel: plain pages
            region.madvise(mmap.MADV_HUGEPAGE)
    return whole[start:start + nbytes]


class NixlSend:
    """Sender end: writes each LAYER's blocks into granted slots, then sends its header."""

    transport = "nixl"

    def __init__(self, agent: NixlAgent, peer: NixlDescriptor, fallback: Any,
                 cap: int = 1) -> None:
        """`cap`: `TransferConfig.coalesce_max_parts`."""
        self._agent = agent
        self._peer = peer
        self._peer_name = agent.connect(peer.metadata)
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

    def close(self) -> None:
        with self._cv:
            self._closed = True
            read, reg, self._credit_reg = self._read, self._credit_reg, None
            self._cv.notify_all()
        if read is not None:  # waits for a read under way; later ones fail
            read.release()
        if reg is not None:
            self._agent.deregister(reg)

    def send_layers(self, channel: Channel, items: Sequence[Outgoing],
                    timeout_s: float) -> list[int]:
        """Write the items' blocks into granted slots, as few messages as `coalesce` allows;
        an item that cannot use a slot goes inline, in its place in the order."""
        sizes: list[int] = []
        parts: list[_Part] = []
        regs: list[Registration] = []
        try:
            granted = self._wait_granted(time.monotonic() + timeout_s)
            for item in items:
                payload = carrier.to_carrier(item.payload)
                nbytes = payload.numel() * payload.element_size()
                per_block = nbytes // max(len(item.header.blocks), 1)
                if not granted or not 0 < per_block <= self._peer.slot_bytes \
                        or not self._peer.accepts(payload):
                    self._flush(channel, parts, timeout_s)  # what precedes it goes first
                    self._fallback.send_layers(channel, [item], timeout_s)
                else:
                    if item.ready is not None:
                        item.ready.synchronize()  # a CUDA payload: NIXL copies outside streams
                    regs.append(self._agent.register(payload))
                    parts += _split(item, payload, per_block, self._peer.slot_bytes)
                sizes.append(nbytes)
            self._flush(channel, parts, timeout_s)
        finally:
            for reg in regs:
                self._agent.deregister(reg)
        return sizes

    def _flush(self, channel: Channel, parts: list[_Part], timeout_s: float) -> None:
        """Send `parts` (emptying it): per message, one NIXL write of its slots, then its
        header (a LAYER, or a BATCH of them)."""
        while parts:
            deadline = time.monotonic() + timeout_s
            slots = self._take(len(parts), deadline)
            run, parts[:] = parts[:len(slots)], parts[len(slots):]
            dev = run[0].payload.get_device() if run[0].payload.is_cuda else 0
            try:
                self._agent.write(self._peer_name, self._peer.mem, dev,
                                  [(p.src, p.nbytes) for p in run],
                                  [(self._peer.slot_address(s), p.nbytes)
                                   for p, s in zip(run, slots, strict=True)],
                                  max(deadline - time.monotonic(), 0.001))
            except NixlWriteError as exc:
                raise ChannelClosed(str(exc)) from None
            header = wire.batch(tuple(dataclasses.replace(p.header, slot=s)
                                      for p, s in zip(run, slots, strict=True)))
            # not waited for here: the next message's write overlaps its delivery
            channel.post(FORWARD_TAG, header, max(deadline - time.monotonic(), 0.001))

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

    def _await_credit(self, target: int, deadline: float) -> None:
        """Read the receiver's credit counter until it has released `target` parts; short
        pauses between reads (each ~2 us) so a wait costs the cores next to nothing."""
        pause = 0.0
        while True:
            if self._closed:
                raise ChannelClosed("pair closed")
            try:
                self._read.read(max(deadline - time.monotonic(), 0.001))
            except NixlWriteError as exc:
                raise ChannelClosed(str(exc)) from None
            count, check = self._credit.tolist()
            # a torn read (count and complement from different updates) is read again; a
            # count that goes back or past what was written is the receiver's bug or worse
            if count == ~check:
                if not self._released <= count <= self._written:
                    raise ProtocolError(f"credit counter says {count} parts released, of "
                                        f"{self._written} written ({self._released} before)")
                self._released = count
                if count >= target:
                    return
            if time.monotonic() >= deadline:
                raise ChannelClosed("the receiver released no landing slot in time")
            pause = min(_POLL_MAX_S, pause * 2 or 0.00002)
            time.sleep(pause)

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
    """Receiver end: owns some of the pool's slots, hands them out and takes them back."""

    transport = "nixl"

    def __init__(self, pool: LandingPool | None, want: int, fallback: Any) -> None:
        self._pool = pool
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

    def start(self, channel: Channel, timeout_s: float) -> None:
        channel.send(BACKWARD_TAG, Header(Kind.GRANT, slots=tuple(self._slots),
                                          credit=self._credit_address), None, timeout_s)

    def payload(self, channel: Channel, header: Header, timeout_s: float) -> torch.Tensor:
        if header.slot < 0:
            return self._fallback.payload(channel, header, timeout_s)
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

    def release(self, channel: Channel, parts: Sequence[Header], timeout_s: float) -> None:
        done = sum(1 for p in parts if p.slot >= 0)
        if done:  # the handler copied them out: the sender may write them again
            self._released += done
            self._publish(self._released)

    def close(self, clean: bool) -> None:
        if self._pool is not None and self._slots:
            self._pool.give_back(self._slots, quarantined=not clean)
            self._slots = []

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
