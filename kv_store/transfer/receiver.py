"""`KVReceiver`: the decode side of the transfer engine, and the `ReceiveSink` it feeds.

Owns the TCPStore server that senders rendezvous through, the pairs they open (capped; the
least recently used idle pair is asked to close to make room), and the receive-side record of
every request (state and deadline). Three kinds of threads: one accept loop, one receive loop
per pair, one watchdog for deadlines. Sink calls for one request never overlap and never follow
its terminal call (`on_done` or `on_failed`, exactly one of which is made per request).

With a NIXL agent (`nixl`), the receiver also registers a landing pool once and offers it in
`nixl_descriptor` (for the owner to hand out over its authenticated control plane); pairs
whose hello names transport "nixl" get slots of it (`nixl_path`), and their payloads reach the
sink as views of those slots. A sender on this host may offer its own staging slots instead
(`nixl_read`): then a sink that lands payloads itself (`reads_in_place`) gets `RemoteKV`s and
reads them straight into its memory (`nixl_destinations`, registered once: the paged cache);
any other sink gets them read into a landing slot first. Nothing else differs between
transports.

A request's deadline is its sender's lease: every LAYER/DONE header says what is left of it,
and the request fails (`on_failed`) when it runs out before the DONE marker arrived.

With a ticket book (`tickets`: the ticket of each request the owner expects now, handed out
with its reservation) every LAYER/DONE/ABORT header must carry the tag of its request's
current ticket (`auth.ticket_tag`) before it may touch a record, so no frame of another
transfer (a cluster member that was not handed it, a late frame of an earlier attempt under
the same id) writes into it, ends it, or ties it to a pair that then goes down:

    header ─► tickets(rid) ─ None (not expected: ended, never reserved) ─► dropped
                 │ ticket
                 ├─ tag wrong ─► refused (counted in `frames_refused`), the pair goes on
                 └─ tag right ─► the request's record, as below
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from kv_store.transfer import auth, rendezvous
from kv_store.transfer.auth import PairKeys
from kv_store.transfer.config import TransferConfig
from kv_store.transfer.nixl_agent import NixlAgent
from kv_store.transfer.nixl_path import LandingPool, NixlReceive
from kv_store.transfer.nixl_read import LocalRegions, RemoteKV
from kv_store.transfer.payload import InlineReceive, ReceivePath
from kv_store.transfer.receiver_pair import ReceiverPair
from kv_store.transfer.rendezvous import Hello, Reply
from kv_store.transfer.state import History, TransferState, check_transition
from kv_store.transfer.stats import TransferStats
from kv_store.transfer.wire import Header, Kind, ProtocolError

log = logging.getLogger(__name__)
_WILDCARDS = ("", "0.0.0.0", "::")


class ReceiveSink(Protocol):
    """Implemented by the decode worker; called from the receiver's threads."""

    def on_layer(self, request_id: str, layer: int, block_ids: list[int], kv: torch.Tensor,
                 head_start: int = 0) -> None:
        """One layer's blocks arrived; `kv[i]` belongs in block `block_ids[i]`. `kv` is valid
        only during the call (it may be a view of a NIXL landing slot): copy what you keep. A
        sink that receives head slices (`head_start` > 0, tensor-parallel re-sharding) takes
        the keyword; it is only passed when non-zero. A sink whose `reads_in_place` is True
        may be given a `RemoteKV` instead (`nixl_read`), which it lands with `read_runs`."""

    def on_done(self, request_id: str, body: bytes) -> None:
        """Every layer of the request arrived; `body` is what the sender passed to finish()."""

    def on_failed(self, request_id: str, reason: str) -> None:
        """The sender aborted, the pair died mid-transfer, or the request timed out."""


@dataclass(eq=False)
class _Inbound:
    """Receiver-side record of one request (state guarded by the receiver's lock)."""

    request_id: str
    state: TransferState
    deadline: float
    started: float
    pair: ReceiverPair | None = None
    deliver: threading.Lock = field(default_factory=threading.Lock)  # serialises sink calls


class KVReceiver:
    """Accepts pairs from senders and delivers their layers to `sink`."""

    def __init__(
        self, host: str, port: int, sink: ReceiveSink, config: TransferConfig | None = None,
        tickets: Callable[[str], bytes | None] | None = None,
        nixl: NixlAgent | None = None, nixl_device: torch.device | None = None,
        nixl_destinations: Sequence[torch.Tensor] = (),
    ) -> None:
        """`tickets(wire request id)`: the ticket that request's frames must be tagged under,
        None if it is not expected (see the module docstring); None = frames are not bound
        to tickets (transport tools and tests). `nixl`: this process's NIXL agent, with
        which the landing pool is registered (on `nixl_device`, default the CPU), and the
        memory the sink lands payloads in (`nixl_destinations`, contiguous tensors: the paged
        cache), so that reads from a same-host sender go straight there."""
        if not isinstance(host, str):
            raise ValueError(f"host must be a str, got {type(host).__name__}")
        if not isinstance(port, int) or not 0 <= port < 65536:
            raise ValueError(f"port must be an int in 0..65535, got {port!r}")
        self._config = config or TransferConfig()
        self._sink = sink
        self._tickets = tickets
        self._host = host
        # Listen on exactly `host`: a TCPStore left to itself binds every interface.
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.bind((host, port))
            listener.listen(128)
        except OSError:
            listener.close()
            raise
        self._store = dist.TCPStore(host, listener.getsockname()[1], None, True,
                                    timedelta(seconds=self._config.connect_timeout_s),
                                    wait_for_workers=False, master_listen_fd=listener.detach())
        shown = f"[{host}]" if ":" in host else host
        self.address = f"{shown}:{self._store.port}"
        self._pool: LandingPool | None = None
        self._regions: LocalRegions | None = None
        self._in_place = bool(getattr(sink, "reads_in_place", False))
        if nixl is not None:
            self._pool = LandingPool(nixl, self._config.nixl_pool_bytes,
                                     self._config.nixl_slot_bytes, nixl_device,
                                     quarantine_s=self._config.io_timeout_s)
            self._regions = LocalRegions(nixl)
            for tensor in nixl_destinations:
                self._regions.add(tensor)
        self.nixl_descriptor = self._pool.descriptor.encode() if self._pool else b""
        """What a sender needs to write into this receiver's landing pool (b"": none)."""
        self._lock = threading.Lock()
        self._pairs: OrderedDict[int, ReceiverPair] = OrderedDict()
        self._bound: dict[ReceiverPair, set[str]] = {}
        self._records: dict[str, _Inbound] = {}
        self._offered: OrderedDict[int, None] = OrderedDict()  # pair ids seen (accept loop)
        self._history = History(self._config.history_size)
        self._stats = TransferStats()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._accept_loop, name="kv-accept", daemon=True),
            threading.Thread(target=self._watchdog, name="kv-watchdog", daemon=True),
        ]
        self._started = False
        self._default_cuda: int | None = None

    # ---- public API --------------------------------------------------------------------------

    def start(self) -> None:
        if self._started:
            raise RuntimeError("KVReceiver.start() called twice")
        self._started = True
        if torch.cuda.is_available():  # NCCL pairs land on the device current at start()
            self._default_cuda = torch.cuda.current_device()
        for thread in self._threads:
            thread.start()

    def expect(self, request_id: str, timeout_s: float) -> None:
        """Fail (`on_failed`) the request unless its DONE arrives within `timeout_s`."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        if not isinstance(timeout_s, int | float) or timeout_s <= 0:
            raise ValueError(f"timeout_s must be a positive number, got {timeout_s!r}")
        now = time.monotonic()
        with self._lock:
            rec = self._records.get(request_id)
            if rec is not None:
                rec.deadline = now + timeout_s
            elif self._history.get(request_id) is None:
                self._records[request_id] = _Inbound(
                    request_id, TransferState.PENDING, now + timeout_s, now)

    def state(self, request_id: str) -> TransferState:
        """State of a live or recently finished request; `KeyError` if unknown."""
        with self._lock:
            rec = self._records.get(request_id)
            found = rec.state if rec is not None else self._history.get(request_id)
        if found is None:
            raise KeyError(f"unknown request_id {request_id!r}")
        return found

    def stats(self) -> dict[str, Any]:
        with self._lock:
            extra = {"pairs_open": len(self._pairs), "transfers_active": len(self._records),
                     "pairs_nixl": sum(1 for p in self._pairs.values() if p.nixl),
                     "pairs_nixl_reading": sum(1 for p in self._pairs.values() if p.reading)}
        if self._pool is not None:
            extra["nixl_slots_free"] = self._pool.num_free
        return self._stats.snapshot(**extra)

    def close(self) -> None:
        """Close every pair (senders see it at once), fail live requests, stop the threads."""
        self._stop.set()
        for thread in self._threads:
            if thread.is_alive():
                thread.join()
        with self._lock:
            pairs = list(self._pairs.values())
        for pair in pairs:
            pair.abort()
        for pair in pairs:
            pair.join(self._config.close_timeout_s)
        with self._lock:
            leftover = list(self._records.values())
        for rec in leftover:
            self._fail(rec, "receiver closed")
        if self._pool is not None:
            self._pool.close()
            self._regions.close()
        self._store = None  # the store server stops with its last reference

    def __enter__(self) -> KVReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- pair handler (called from pair threads) ---------------------------------------------

    def on_message(self, pair: ReceiverPair, header: Header,
                   payload: torch.Tensor | RemoteKV | None) -> None:
        if not self._ticket_ok(pair, header):
            return
        rec = self._record_for(pair, header)
        if rec is None:
            return  # the request ended earlier (timed out, aborted): a late message
        if header.kind is Kind.LAYER:
            read = isinstance(payload, RemoteKV)
            nbytes = payload.nbytes if read else payload.numel() * payload.element_size()
            self._stats.add_received(nbytes, header.slot >= 0, read)
            self._deliver_layer(rec, header, payload)
        elif header.kind is Kind.DONE:
            self._deliver_done(rec, header.body)
        else:
            self._fail(rec, f"sender aborted: {header.reason}")

    def on_down(self, pair: ReceiverPair, reason: str) -> None:
        with self._lock:
            if self._pairs.get(pair.pair_id) is pair:
                del self._pairs[pair.pair_id]
            rids = sorted(self._bound.pop(pair, ()))
            recs = [self._records[r] for r in rids if r in self._records]
        for rec in recs:
            self._fail(rec, reason)

    # ---- delivery ----------------------------------------------------------------------------

    def _ticket_ok(self, pair: ReceiverPair, header: Header) -> bool:
        """May this frame go to its request? (See the module docstring.)"""
        if self._tickets is None:
            return True
        ticket = self._tickets(header.rid)
        if ticket is None:
            log.debug("dropped a %s frame for %s: not expected", header.kind.value, header.rid)
            return False
        if auth.tag_matches(ticket, header):
            return True
        self._stats.record_frame_refused()
        log.warning("refused a %s frame for %s from %s: not tagged under the ticket of the "
                    "transfer this worker expects", header.kind.value, header.rid, pair.peer)
        return False

    def _record_for(self, pair: ReceiverPair, header: Header) -> _Inbound | None:
        request_id = header.rid
        now = time.monotonic()
        lease_end = now + (header.lease_s if header.kind is not Kind.ABORT else 0.0)
        with self._lock:
            rec = self._records.get(request_id)
            if rec is None:
                if self._history.get(request_id) is not None:
                    return None
                rec = _Inbound(request_id, TransferState.PENDING, lease_end, now)
                self._records[request_id] = rec
            elif header.kind is not Kind.ABORT:
                rec.deadline = min(rec.deadline, lease_end)  # the sender's lease, as it says
            if rec.pair is None:
                rec.pair = pair
                self._bound.setdefault(pair, set()).add(request_id)
            return rec

    def _deliver_layer(self, rec: _Inbound, header: Header, kv: torch.Tensor | RemoteKV
                       ) -> None:
        with rec.deliver:
            if not self._begin(rec):
                return
            try:
                if isinstance(kv, RemoteKV) and not self._in_place:
                    kv = kv.tensor()
                if header.head_start:
                    self._sink.on_layer(rec.request_id, header.layer, list(header.blocks), kv,
                                        head_start=header.head_start)
                else:
                    self._sink.on_layer(rec.request_id, header.layer, list(header.blocks), kv)
                return
            except Exception as exc:  # a sink bug fails this request, not the pair
                log.exception("ReceiveSink.on_layer raised for %s", rec.request_id)
                reason = f"sink rejected layer {header.layer}: {exc!r}"
        self._fail(rec, reason)

    def _deliver_done(self, rec: _Inbound, body: bytes) -> None:
        with rec.deliver:
            if not self._begin(rec):
                return
            with self._lock:
                self._end_locked(rec, TransferState.DONE, "")
            _call(self._sink.on_done, rec.request_id, body)

    def _fail(self, rec: _Inbound, reason: str) -> None:
        with rec.deliver:
            with self._lock:
                if rec.state.terminal:
                    return
                self._end_locked(rec, TransferState.FAILED, reason)
            _call(self._sink.on_failed, rec.request_id, reason)

    def _begin(self, rec: _Inbound) -> bool:
        """Mark data arriving for `rec`; False if it already ended."""
        with self._lock:
            if rec.state.terminal:
                return False
            if rec.state is TransferState.PENDING:
                check_transition(rec.state, TransferState.TRANSFERRING)
                rec.state = TransferState.TRANSFERRING
                rec.started = time.monotonic()
            return True

    def _end_locked(self, rec: _Inbound, state: TransferState, reason: str) -> None:
        check_transition(rec.state, state)
        rec.state = state
        self._records.pop(rec.request_id, None)
        self._history.add(rec.request_id, state, reason)
        if rec.pair is not None:
            self._bound.get(rec.pair, set()).discard(rec.request_id)
        if state is TransferState.DONE:
            self._stats.record_done(time.monotonic() - rec.started)
        else:
            self._stats.record_failed()

    # ---- accept loop and watchdog ------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._stop.wait(self._config.poll_interval_s):
            try:
                offers = rendezvous.poll(self._store)
            except RuntimeError as exc:
                log.warning("polling the rendezvous store failed: %s", exc)
                continue
            for pair_id, hello in offers:
                try:
                    self._accept(pair_id, hello)
                except Exception:  # one bad offer must not stop the accept loop
                    log.exception("accepting pair %d failed", pair_id)

    def _accept(self, pair_id: int, hello: Hello | ProtocolError) -> None:
        if not self._first_offer(pair_id):
            return  # a replayed pair id: its hello was answered already
        key = self._config.auth_key
        nonce = auth.new_nonce()
        refusal = str(hello) if isinstance(hello, ProtocolError) else self._refusal(pair_id, hello)
        sender_nonce = b"" if isinstance(hello, ProtocolError) else hello.nonce
        if refusal:
            self._stats_refused(pair_id, refusal)
            rendezvous.answer(self._store, pair_id, Reply(False, refusal), key, sender_nonce,
                              nonce)
            return
        cfg = self._config
        keys = PairKeys.derive(key, pair_id, sender_nonce, nonce) if key else None
        pair = ReceiverPair(pair_id, hello, self._store.clone(), self._gloo_host(hello),
                            self._cuda_device(hello), cfg, self, keys,
                            self._stats.record_message)
        victim = None
        with self._lock:
            live = [p for p in self._pairs.values() if not p.closing]
            if len(live) >= cfg.max_pairs:
                victim = self._lru_idle(live)
                if victim is None:
                    refusal = f"receiver {self.address} has max_pairs={cfg.max_pairs} busy pairs"
            if not refusal:
                self._pairs[pair_id] = pair
                self._bound[pair] = set()
        if victim is not None:
            victim.request_close("evicted: max_pairs reached")
        if refusal:
            rendezvous.answer(self._store, pair_id, Reply(False, refusal), key, sender_nonce,
                              nonce)
            return
        pair.start(self._path_for(hello))  # takes landing slots only for an accepted pair
        rendezvous.answer(self._store, pair_id, Reply(True), key, sender_nonce, nonce)

    def _first_offer(self, pair_id: int) -> bool:
        """True the first time `pair_id` is offered (the store's queue is writable by anyone:
        an id pushed again must not open a second pair on the same keys)."""
        if pair_id in self._offered:
            return False
        self._offered[pair_id] = None
        while len(self._offered) > self._config.history_size:
            self._offered.popitem(last=False)
        return True

    def _stats_refused(self, pair_id: int, reason: str) -> None:
        self._stats.record_refused()
        log.warning("refused pair %d: %s", pair_id, reason)

    def _refusal(self, pair_id: int, hello: Hello) -> str:
        key = self._config.auth_key
        if key is not None:
            try:
                hello.check(key, pair_id)
            except ProtocolError as exc:
                return str(exc)
        if self._stop.is_set():
            return f"receiver {self.address} is closing"
        if hello.transport == "nccl" and not torch.cuda.is_available():
            return f"receiver {self.address} has no CUDA device for an NCCL pair"
        return ""

    def _path_for(self, hello: Hello) -> ReceivePath:
        """A NIXL pair gets landing slots (none without a pool, or when it is used up: its
        payloads then come inline); others receive inline."""
        if hello.transport != "nixl":
            return InlineReceive()
        return NixlReceive(self._pool, self._config.nixl_slots_per_pair, InlineReceive(),
                           self._regions, self._config.io_timeout_s)

    def _lru_idle(self, pairs: list[ReceiverPair]) -> ReceiverPair | None:
        idle = [p for p in pairs if not self._bound.get(p)]
        return min(idle, key=lambda p: p.last_used) if idle else None

    def _gloo_host(self, hello: Hello) -> str:
        if self._host in _WILDCARDS:  # bound everywhere: listen where this sender reaches us
            return rendezvous.local_host_for(hello.host)
        return self._host

    def _cuda_device(self, hello: Hello) -> torch.device | None:
        if hello.transport != "nccl":
            return None
        index = self._config.cuda_device
        return torch.device("cuda", index if index is not None else (self._default_cuda or 0))

    def _watchdog(self) -> None:
        while not self._stop.wait(self._config.poll_interval_s):
            now = time.monotonic()
            with self._lock:
                expired = [r for r in self._records.values() if now >= r.deadline]
                overdue = [p for p in self._pairs.values() if p.overdue(now)]
            for rec in expired:
                self._fail(rec, "timed out: the lease ran out before the DONE marker")
            for pair in overdue:
                pair.abort()


def _call(method: Any, *args: Any) -> None:
    try:
        method(*args)
    except Exception:  # a sink bug must not kill the receiver's threads
        log.exception("ReceiveSink.%s raised", getattr(method, "__name__", "?"))
