"""`KVSender`: the prefill side of the transfer engine.

Owns the requests being sent (their state, lease and future) and the table of pairs to
receivers (capped, least recently used first out, idle ones closed). Layers are queued on the
pair of their receiver and sent by that pair's thread, so `send_layer` never blocks on the wire;
layers that wait in the queue together leave in one message (`coalesce`). A housekeeping
thread enforces leases and idle timeouts.

A request's future resolves when its DONE is on the wire, handed to the receiver's pair (frames
are pipelined: the receiver may still be copying earlier layers); whether every layer landed
is the receiving sink's verdict, which the workers act on.

A request's lease starts with its first call (`lease_s`, at most `TransferConfig.lease_s`) and
covers everything up to its DONE marker being on the wire; every header carries what is left
of it, so the receiver drops the request when the sender does. Its ticket (`ticket`, the key
the receiving worker handed out for this transfer) is fixed by the first call too, and tags
every header of the request (`auth.ticket_tag`): the receiver accepts only those.

With a NIXL agent (`nixl`), a receiver whose landing pool the caller registered with
`add_peer` (its `NixlDescriptor`, handed out by the receiving worker over gRPC) gets pairs of
transport "nixl": their payloads are written into the pool (`nixl_path`) or, for a receiver
on this host, copied into this sender's staging pool for the receiver to read (`nixl_read`,
`TransferConfig.nixl_reads`); every other receiver, and payloads on another device than the
pool, use gloo/NCCL as configured.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from kv_store.transfer import auth, carrier
from kv_store.transfer.checks import check_body, check_layer, check_lease, check_request_id
from kv_store.transfer.config import TransferConfig
from kv_store.transfer.nixl_agent import NixlAgent, is_local_host
from kv_store.transfer.nixl_path import LandingPool, NixlDescriptor
from kv_store.transfer.rendezvous import parse_address
from kv_store.transfer.sender_pair import Outgoing, SenderPair
from kv_store.transfer.state import (
    History,
    TransferError,
    TransferResult,
    TransferState,
    check_transition,
)
from kv_store.transfer.stats import TransferStats
from kv_store.transfer.wire import Header, Kind

_PairKey = tuple[str, str, str]  # (address, transport, device)
_Settle = Callable[[], None]     # resolves a future once the lock is released


@dataclass(eq=False)
class _Outbound:
    """Sender-side record of one request's transfer (guarded by the KVSender's lock)."""

    request_id: str
    address: str
    created: float
    lease_deadline: float
    ticket: bytes = field(default=b"", repr=False)  # tags every header (b"": unbound)
    future: Future = field(default_factory=Future)
    state: TransferState = TransferState.PENDING
    pair: SenderPair | None = None
    finished: bool = False  # finish() was called: only its DONE is left to send
    layers: int = 0
    nbytes: int = 0


class KVSender:
    """Streams KV layers to decode workers; thread-safe; one per prefill process."""

    def __init__(self, config: TransferConfig | None = None,
                 nixl: NixlAgent | None = None) -> None:
        """`nixl`: this process's NIXL agent (None: gloo/NCCL only)."""
        self._config = config or TransferConfig()
        self._nixl = nixl
        self._peers: dict[str, NixlDescriptor] = {}  # landing pools by receiver address
        self._staging: LandingPool | None = None  # what same-host receivers read (lazily)
        self._local: dict[str, bool] = {}  # receiver address -> on this host
        self._lock = threading.Lock()
        self._pairs: OrderedDict[_PairKey, SenderPair] = OrderedDict()  # LRU order
        self._bound: dict[SenderPair, set[str]] = {}  # live requests riding on each pair
        self._requests: dict[str, _Outbound] = {}
        self._history = History(self._config.history_size)
        self._stats = TransferStats()
        self._closed = False
        self._stop = threading.Event()
        self._keeper = threading.Thread(target=self._housekeep, name="kv-sender", daemon=True)
        self._keeper.start()

    # ---- public API --------------------------------------------------------------------------

    def add_peer(self, address: str, descriptor: bytes) -> None:
        """The receiver at `address` offers this landing pool (`KVReceiver.nixl_descriptor`,
        b"" for none); pairs opened to it from now on use NIXL when this sender has an agent.
        `ValueError` for a malformed descriptor."""
        parse_address(address)
        pool = NixlDescriptor.decode(descriptor) if descriptor else None
        with self._lock:
            if pool is None:
                self._peers.pop(address, None)
            else:
                self._peers[address] = pool

    @property
    def nixl_enabled(self) -> bool:
        return self._nixl is not None

    def stage(self, address: str, shape: Sequence[int], dtype: torch.dtype
              ) -> torch.Tensor | None:
        """An empty CPU tensor in a slot of this process's staging pool, for a payload to
        the receiver at `address` to be gathered into: sent with `send_layer`, the receiver
        reads it from there (`nixl_read`), with no copy on this side. None where that does
        not apply (no NIXL, a receiver on another host, reads off, no slot free, a payload
        larger than a slot): gather into a tensor of your own."""
        if self._nixl is None:
            return None
        with self._lock:
            staging = (self._staging_for(address) if address in self._peers and not
                       self._closed else None)
        if staging is None:
            return None
        nbytes = math.prod(shape) * dtype.itemsize
        lent = staging.lend(nbytes)
        return None if lent is None else lent.view(dtype).view(tuple(shape))

    def send_layer(
        self, address: str, request_id: str, layer: int, block_ids: Sequence[int],
        kv: torch.Tensor, head_start: int = 0, lease_s: float | None = None,
        ticket: bytes = b"",
    ) -> None:
        """Queue one layer's blocks for `address` (non-blocking); `kv` must not change later.
        `head_start` is the global index of kv's first KV head (dim 2) when it is a slice.
        `lease_s` sets the request's lease on its first call (default: the config's);
        `ticket` is the transfer's, from the receiver's hand-off (b"": none)."""
        blocks = check_layer(self._config, address, request_id, layer, block_ids, kv)
        if not isinstance(head_start, int) or head_start < 0:
            raise ValueError(f"head_start must be a non-negative int, got {head_start!r}")
        check_lease(lease_s)
        auth.check_ticket(ticket)
        settle: list[_Settle] = []
        with self._lock:
            transport, device = self._transport_for(kv, address)
            rec = self._live_record(address, request_id, "send_layer", lease_s, ticket)
            if rec is not None:
                header = Header(Kind.LAYER, rid=request_id, layer=layer, blocks=blocks,
                                shape=tuple(kv.shape), dtype=carrier.dtype_name(kv.dtype),
                                head_start=head_start, lease_s=_left(rec))
                self._enqueue(rec, Outgoing(auth.tagged(header, rec.ticket), kv,
                                            _ready_event(kv), rec.ticket),
                              transport, device, settle)
        _run(settle)

    def finish(self, address: str, request_id: str, body: bytes,
               lease_s: float | None = None, ticket: bytes = b"") -> Future[TransferResult]:
        """After the queued layers, send DONE carrying `body` (the caller's encoded message);
        the future says how it went. `lease_s` and `ticket` as for `send_layer`."""
        parse_address(address)
        check_request_id(request_id)
        check_body(body)
        check_lease(lease_s)
        auth.check_ticket(ticket)
        settle: list[_Settle] = []
        with self._lock:
            rec = self._live_record(address, request_id, "finish", lease_s, ticket)
            if rec is None:  # already failed: its future carries the reason
                return self._failed_future(request_id)
            if rec.finished:
                raise ValueError(f"finish() called twice for request {request_id!r}")
            rec.finished = True
            transport, device = ("gloo", None) if rec.pair is None else self._key_of(rec.pair)
            done = Header(Kind.DONE, rid=request_id, body=bytes(body), lease_s=_left(rec))
            self._enqueue(rec, Outgoing(auth.tagged(done, rec.ticket)), transport, device,
                          settle)
            future = rec.future
        _run(settle)
        return future

    def abort(self, address: str, request_id: str, reason: str, ticket: bytes = b"") -> None:
        """Drop the request's queued layers, fail it, and tell the receiver (under the
        request's ticket; `ticket` for a request that sent nothing yet)."""
        parse_address(address)
        check_request_id(request_id)
        auth.check_ticket(ticket)
        settle: list[_Settle] = []
        with self._lock:
            rec = self._requests.get(request_id)
            pair = rec.pair if rec is not None else None
            if rec is not None:
                ticket = rec.ticket
                self._end(rec, TransferState.FAILED, f"aborted: {reason}", settle)
            elif self._history.get(request_id) is None:
                self._history.add(request_id, TransferState.FAILED)
            self._tell_abort(address, request_id, reason, ticket, pair, settle)
        _run(settle)

    def state(self, request_id: str) -> TransferState:
        """Current state of a live or recently finished request; `KeyError` if unknown."""
        with self._lock:
            rec = self._requests.get(request_id)
            found = rec.state if rec is not None else self._history.get(request_id)
        if found is None:
            raise KeyError(f"unknown request_id {request_id!r}")
        return found

    def stats(self) -> dict[str, Any]:
        with self._lock:
            extra = {"pairs_open": len(self._pairs), "transfers_active": len(self._requests),
                     "pairs_nixl": sum(1 for p in self._pairs.values()
                                       if p.transport == "nixl"),
                     "pairs_nixl_reading": sum(1 for p in self._pairs.values() if p.reading),
                     # waits for a landing slot to come back (backpressure), open pairs
                     "nixl_slot_waits": sum(p.slot_waits for p in self._pairs.values())}
            staging = self._staging
        if staging is not None:  # its slots are lent, or held back after a pair broke
            extra["nixl_staging_free"] = staging.num_free
        return self._stats.snapshot(**extra)

    def close(self) -> None:
        """Fail every live request, close every pair cleanly, stop the threads."""
        settle: list[_Settle] = []
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for rec in list(self._requests.values()):
                self._end(rec, TransferState.FAILED, "sender closed", settle)
            pairs = list(self._pairs.values())
            self._pairs.clear()
        _run(settle)
        for pair in pairs:
            pair.close("sender closed")
        self._stop.set()
        self._keeper.join()
        for pair in pairs:
            pair.join(2 * self._config.close_timeout_s)
        for pair in pairs:  # a receiver that hangs must not keep our threads blocked
            pair.abort("sender closed")
            pair.join(self._config.close_timeout_s)
        if self._staging is not None:  # its memory outlives a read still under way
            self._staging.close()

    def __enter__(self) -> KVSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- pair listener (called from pair threads) --------------------------------------------

    def on_wire(self, pair: SenderPair, item: Outgoing) -> bool:
        if item.header.kind in (Kind.ABORT, Kind.CLOSE):
            return True
        settle: list[_Settle] = []
        with self._lock:
            rec = self._requests.get(item.header.rid)
            if rec is None or rec.pair is not pair:
                return False  # ended (aborted, expired) after it was queued
            if time.monotonic() >= rec.lease_deadline:  # not a tick later: nothing past it
                self._expire_one(rec, settle)
                go = False
            else:
                go = True
                if rec.state is TransferState.PENDING:
                    check_transition(rec.state, TransferState.TRANSFERRING)
                    rec.state = TransferState.TRANSFERRING
        _run(settle)
        return go

    def on_sent(self, pair: SenderPair, item: Outgoing, nbytes: int) -> None:
        self._stats.add_sent(nbytes)
        settle: list[_Settle] = []
        with self._lock:
            rec = self._requests.get(item.header.rid)
            if rec is None or rec.pair is not pair:
                return
            if item.header.kind is Kind.LAYER:
                rec.layers += 1
                rec.nbytes += nbytes
            elif item.header.kind is Kind.DONE:
                self._end(rec, TransferState.DONE, "", settle)
        _run(settle)

    def on_down(self, pair: SenderPair, reason: str) -> None:
        settle: list[_Settle] = []
        with self._lock:
            if self._pairs.get(pair.key) is pair:
                del self._pairs[pair.key]
            for request_id in sorted(self._bound.pop(pair, ())):
                rec = self._requests.get(request_id)
                if rec is not None:
                    self._end(rec, TransferState.FAILED, reason, settle)
        _run(settle)

    # ---- requests (caller holds self._lock) --------------------------------------------------

    def _live_record(self, address: str, request_id: str, caller: str,
                     lease_s: float | None, ticket: bytes) -> _Outbound | None:
        """The request's live record, created if new (its lease starts, its ticket is
        fixed); None if it already failed."""
        if self._closed:
            raise RuntimeError("KVSender is closed")
        rec = self._requests.get(request_id)
        if rec is not None:
            if rec.address != address:
                raise ValueError(f"request {request_id!r} goes to {rec.address}, not {address}")
            if rec.ticket != ticket:
                raise ValueError(f"request {request_id!r} was started under another ticket")
            if rec.finished and caller == "send_layer":
                raise ValueError(f"send_layer() after finish() for request {request_id!r}")
            return rec
        past = self._history.get(request_id)
        if past is TransferState.DONE:
            raise ValueError(f"request {request_id!r} was already sent completely")
        if past is TransferState.FAILED:
            return None
        now = time.monotonic()
        lease = self._config.lease_s if lease_s is None else min(lease_s, self._config.lease_s)
        rec = _Outbound(request_id, address, now, now + lease, ticket)
        self._requests[request_id] = rec
        return rec

    def _enqueue(
        self, rec: _Outbound, item: Outgoing, transport: str, device: torch.device | None,
        settle: list[_Settle],
    ) -> None:
        if rec.pair is None:
            try:
                rec.pair = self._pair_for(rec.address, transport, device)
            except TransferError as exc:
                self._end(rec, TransferState.FAILED, str(exc), settle)
                return
            self._bound[rec.pair].add(rec.request_id)
        elif rec.pair.key != (rec.address, transport, str(device)):
            raise ValueError(f"all layers of request {rec.request_id!r} must be on one device")
        if not rec.pair.enqueue(item):
            self._end(rec, TransferState.FAILED, f"pair to {rec.address} is closing", settle)

    def _end(self, rec: _Outbound, state: TransferState, reason: str,
             settle: list[_Settle]) -> None:
        """Move a live request to DONE or FAILED, release what it holds, settle its future."""
        check_transition(rec.state, state)
        rec.state = state
        del self._requests[rec.request_id]
        self._history.add(rec.request_id, state, reason)
        if rec.pair is not None:
            self._bound.get(rec.pair, set()).discard(rec.request_id)
            rec.pair.drop(rec.request_id)  # queued payloads are released here
        future = rec.future
        if state is TransferState.DONE:
            latency = time.monotonic() - rec.created
            self._stats.record_done(latency)
            result = TransferResult(rec.request_id, rec.layers, rec.nbytes, latency)
            settle.append(lambda: future.set_result(result))
        else:
            self._stats.record_failed()
            error = TransferError(f"transfer of {rec.request_id!r} to {rec.address} failed: "
                                  f"{reason}")
            settle.append(lambda: future.set_exception(error))

    def _failed_future(self, request_id: str) -> Future[TransferResult]:
        future: Future[TransferResult] = Future()
        future.set_exception(TransferError(
            f"transfer of {request_id!r} failed: {self._history.reason(request_id)}"))
        return future

    def _tell_abort(self, address: str, request_id: str, reason: str, ticket: bytes,
                    pair: SenderPair | None, settle: list[_Settle]) -> None:
        """Queue an ABORT (tagged under `ticket`) ahead of everything else on a live pair to
        `address`."""
        if pair is None or not pair.accepting:
            pair = next((p for p in self._pairs.values()
                         if p.address == address and p.accepting), None)
        if pair is None:
            try:
                pair = self._pair_for(address, "gloo", None)
            except TransferError:
                return  # no room for a pair: the receiver's own timeout will fail the request
        abort = auth.tagged(Header(Kind.ABORT, rid=request_id, reason=reason), ticket)
        pair.enqueue(Outgoing(abort), front=True)

    # ---- pairs (caller holds self._lock) -----------------------------------------------------

    def _pair_for(self, address: str, transport: str, device: torch.device | None) -> SenderPair:
        if self._closed:
            raise TransferError("sender closed")
        key = (address, transport, str(device))
        pair = self._pairs.get(key)
        if pair is not None and pair.accepting:
            self._pairs.move_to_end(key)
            return pair
        self._pairs.pop(key, None)
        if len(self._pairs) >= self._config.max_pairs and not self._evict_one():
            raise TransferError(f"all max_pairs={self._config.max_pairs} pairs are busy; "
                                f"cannot open one to {address}")
        nixl = None
        if transport == "nixl":
            nixl = (self._nixl, self._peers[address], self._staging_for(address))
        pair = SenderPair(address, transport, device, self._config, self, nixl)
        self._pairs[key] = pair
        self._bound[pair] = set()
        pair.start()
        return pair

    def _staging_for(self, address: str) -> LandingPool | None:
        """This process's staging pool, if the receiver at `address` reads from it (it is on
        this host, and reads are on); made on first use (caller holds self._lock)."""
        if not self._config.nixl_reads:
            return None
        local = self._local.get(address)
        if local is None:  # asked per layer on the engine thread: look the host up once
            local = self._local[address] = is_local_host(parse_address(address)[0])
        if not local:
            return None
        if self._staging is None:
            cfg = self._config
            self._staging = LandingPool(self._nixl, cfg.nixl_pool_bytes, cfg.nixl_slot_bytes,
                                        quarantine_s=cfg.io_timeout_s)
        return self._staging

    def _evict_one(self) -> bool:
        """Close the least recently used idle pair; False if every pair is busy."""
        for key, pair in list(self._pairs.items()):
            if not pair.accepting or self._idle(pair):
                pair.close("evicted: max_pairs reached")
                del self._pairs[key]
                return True
        return False

    def _idle(self, pair: SenderPair) -> bool:
        return not self._bound.get(pair) and pair.quiet()

    def _transport_for(self, kv: torch.Tensor, address: str
                       ) -> tuple[str, torch.device | None]:
        """The pair kind for this payload (caller holds self._lock)."""
        pool = self._peers.get(address)
        if self._nixl is not None and pool is not None and pool.accepts(kv):
            return "nixl", None
        backend = self._config.backend
        if kv.is_cuda and backend in ("auto", "nccl"):
            return "nccl", kv.device
        if backend == "nccl":
            raise ValueError("TransferConfig.backend is 'nccl' but kv is not a CUDA tensor")
        return "gloo", None

    @staticmethod
    def _key_of(pair: SenderPair) -> tuple[str, torch.device | None]:
        return pair.transport, pair.cuda_device

    # ---- housekeeping thread -----------------------------------------------------------------

    def _housekeep(self) -> None:
        while not self._stop.wait(self._config.poll_interval_s):
            settle: list[_Settle] = []
            with self._lock:
                now = time.monotonic()
                self._expire(now, settle)
                self._close_idle(now)
            _run(settle)

    def _expire(self, now: float, settle: list[_Settle]) -> None:
        for rec in list(self._requests.values()):
            if now >= rec.lease_deadline:
                self._expire_one(rec, settle)

    def _expire_one(self, rec: _Outbound, settle: list[_Settle]) -> None:
        reason = f"lease of {rec.lease_deadline - rec.created:.3g}s expired"
        pair = rec.pair
        self._end(rec, TransferState.FAILED, reason, settle)
        self._tell_abort(rec.address, rec.request_id, reason, rec.ticket, pair, settle)

    def _close_idle(self, now: float) -> None:
        for key, pair in list(self._pairs.items()):
            if not pair.accepting:
                del self._pairs[key]
            elif self._idle(pair) and now - pair.last_used >= self._config.idle_timeout_s:
                pair.close(f"idle for {self._config.idle_timeout_s}s")
                del self._pairs[key]


def _left(rec: _Outbound) -> float:
    """What is left of a request's lease, for its next header."""
    return max(0.0, rec.lease_deadline - time.monotonic())


def _ready_event(kv: torch.Tensor) -> Any:
    """For a CUDA tensor, an event marking the end of its producer's work so far."""
    if not kv.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(kv.device))
    return event


def _run(settle: list[_Settle]) -> None:
    for step in settle:
        step()
