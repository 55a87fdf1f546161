"""Transfer engine between real processes on loopback, over every transport.

The pytest process hosts one side; spawned "agent" processes host the other (a sender or a
receiver driven by commands over a pipe, msgpack-encoded). Payloads are generated from the
request id and layer on both sides, so every comparison is exact and bitwise. The whole suite
runs once per payload transport (`transport`): gloo, and NIXL (the receiver's landing pool
offered to each sender with `add_peer`, as the workers do with the descriptor they get over
gRPC), so the state machines, leases and failure handling are checked on both.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import os
import signal
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import msgpack
import pytest
import torch
import torch.distributed as dist

from kv_store.transfer import (
    KVReceiver,
    KVSender,
    TransferConfig,
    TransferError,
    TransferState,
    wire,
)
from kv_store.transfer.nixl_agent import NixlAgent
from kv_store.transfer.nixl_path import NixlDescriptor

CTX = mp.get_context("spawn")
NUM_BLOCKS = 48  # blocks in each cache tensor of a receiver
BLOCK_SHAPE = (2, 2, 16, 8)  # [k/v, kv heads, block size, head dim]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
          "float8_e4m3fn": torch.float8_e4m3fn}
FAST = {"poll_interval_s": 0.02, "close_timeout_s": 1.0}


# ---- deterministic payloads ------------------------------------------------------------------

def make_blocks(rid: str, n: int) -> list[int]:
    gen = torch.Generator().manual_seed(zlib.crc32(rid.encode()))
    return torch.randperm(NUM_BLOCKS, generator=gen)[:n].tolist()


def make_kv(rid: str, layer: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(f"{rid}/{layer}".encode()))
    return (torch.randn((n, *BLOCK_SHAPE), generator=gen) * 4).to(dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


# ---- the pytest process's receive sink -------------------------------------------------------

class RecordingSink:
    """Writes layers into per-(request, layer) byte caches and records every call."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self.events: list[tuple] = []
        self.caches: dict[tuple[str, int], torch.Tensor] = {}

    def on_layer(self, request_id, layer, block_ids, kv):
        raw = as_bytes(kv)
        with self._cv:
            cache = self.caches.setdefault(
                (request_id, layer), torch.zeros((NUM_BLOCKS, *raw.shape[1:]), dtype=torch.uint8))
            cache[block_ids] = raw
            self.events.append(("layer", request_id, layer))
            self._cv.notify_all()

    def on_done(self, request_id, body):
        self._record(("done", request_id, body))

    def on_failed(self, request_id, reason):
        self._record(("failed", request_id, reason))

    def _record(self, event: tuple) -> None:
        with self._cv:
            self.events.append(event)
            self._cv.notify_all()

    def wait_for(self, kind: str, rid: str, timeout: float = 15.0) -> tuple:
        def found():
            return next((e for e in self.events if e[0] == kind and e[1] == rid), None)
        with self._cv:
            self._cv.wait_for(found, timeout)
            event = found()
        assert event is not None, f"no {kind!r} for {rid!r} within {timeout}s: {self.events}"
        return event

    def kinds(self, rid: str) -> list[str]:
        with self._cv:
            return [e[0] for e in self.events if e[1] == rid]

    def assert_exact(self, rid: str, layers: int, n: int, dtype: torch.dtype) -> None:
        blocks = make_blocks(rid, n)
        untouched = sorted(set(range(NUM_BLOCKS)) - set(blocks))
        for layer in range(layers):
            cache = self.caches[(rid, layer)]
            assert torch.equal(cache[blocks], as_bytes(make_kv(rid, layer, n, dtype)))
            assert not cache[untouched].any()


# ---- agent processes -------------------------------------------------------------------------

class AgentSink:
    """Receive sink inside an agent: checks every layer against the expected bytes."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: list[list] = []
        self.devices: set[str] = set()

    def on_layer(self, request_id, layer, block_ids, kv):
        n = len(block_ids)
        ok = block_ids == make_blocks(request_id, n) and torch.equal(
            as_bytes(kv.cpu()), as_bytes(make_kv(request_id, layer, n, kv.dtype)))
        with self.lock:
            self.devices.add(kv.device.type)
            self.events.append(["layer", request_id, layer, ok])

    def on_done(self, request_id, body):
        with self.lock:
            self.events.append(["done", request_id, body])

    def on_failed(self, request_id, reason):
        with self.lock:
            self.events.append(["failed", request_id, reason])


class AgentState:
    """What an agent process holds: senders by config, at most one receiver, and a NIXL
    agent when the suite runs over NIXL."""

    def __init__(self, transport: str) -> None:
        self.nixl = NixlAgent("127.0.0.1") if transport == "nixl" else None
        self.senders: dict[bytes, KVSender] = {}
        self.receiver: KVReceiver | None = None
        self.sink = AgentSink()

    def sender(self, config: dict) -> KVSender:
        key = msgpack.packb(sorted(config.items()))
        if key not in self.senders:
            self.senders[key] = KVSender(TransferConfig(**config), nixl=self.nixl)
        return self.senders[key]

    def op_send(self, address, rid, layers, n, dtype, body=None, config=None, abort=None,
                finish=True, timeout=20.0, lease_s=None, ticket=b"", peer=b""):
        sender = self.sender(config or {})
        sender.add_peer(address, peer)
        for layer in range(layers):
            sender.send_layer(address, rid, layer, make_blocks(rid, n),
                              make_kv(rid, layer, n, DTYPES[dtype]), lease_s=lease_s,
                              ticket=ticket)
        if abort is not None:
            sender.abort(address, rid, abort)
        if abort is not None or not finish:
            return {"state": sender.state(rid).value}
        try:
            result = sender.finish(address, rid, body or b"", ticket=ticket).result(timeout)
        except TransferError as exc:
            return {"state": sender.state(rid).value, "error": str(exc)}
        return {"state": sender.state(rid).value, "layers": result.layers,
                "bytes": result.bytes_sent}

    def op_send_interleaved(self, address, rids, layers, n, dtype, timeout=20.0, peer=b""):
        """Several requests in flight on one pair at once, their layers interleaved."""
        sender = self.sender({})
        sender.add_peer(address, peer)
        for layer in range(layers):
            for rid in rids:
                sender.send_layer(address, rid, layer, make_blocks(rid, n),
                                  make_kv(rid, layer, n, DTYPES[dtype]))
        futures = [sender.finish(address, rid, b"first %d" % i) for i, rid in enumerate(rids)]
        results = [f.result(timeout) for f in futures]
        return {"layers": [r.layers for r in results], "bytes": [r.bytes_sent for r in results]}

    def op_receiver_start(self, config=None):
        if self.receiver is not None:
            self.receiver.close()
        self.sink = AgentSink()
        self.receiver = KVReceiver("127.0.0.1", 0, self.sink, TransferConfig(**(config or {})),
                                   nixl=self.nixl)
        self.receiver.start()
        return {"address": self.receiver.address, "peer": self.receiver.nixl_descriptor}

    def op_events(self, kind=None, rid=None, timeout=15.0):
        end = time.monotonic() + timeout
        while True:
            with self.sink.lock:
                events = list(self.sink.events)
            if kind is None or any(e[0] == kind and e[1] == rid for e in events):
                return {"events": events, "found": True}
            if time.monotonic() > end:
                return {"events": events, "found": False}
            time.sleep(0.01)

    def op_state(self, rid):
        end = time.monotonic() + 10
        while True:
            states = {s.state(rid).value for s in self.senders.values()}
            if states == {"failed"} or time.monotonic() > end:
                return {"state": ",".join(sorted(states))}
            time.sleep(0.02)

    def op_receiver_stats(self):
        return {"stats": self.receiver.stats()}

    def op_sender_stats(self):
        return {"stats": [s.stats() for s in self.senders.values()]}

    def close(self):
        for sender in self.senders.values():
            sender.close()
        if self.receiver is not None:
            self.receiver.close()
        if self.nixl is not None:
            self.nixl.close()


def _agent_main(conn, transport: str) -> None:
    torch.set_num_threads(1)
    state = AgentState(transport)
    while True:
        msg = msgpack.unpackb(conn.recv_bytes())
        if msg["op"] == "stop":
            state.close()
            return
        try:
            reply = {"ok": True, **getattr(state, "op_" + msg["op"])(**msg["args"])}
        except Exception as exc:  # reported to the test, which fails with the message
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        conn.send_bytes(msgpack.packb(reply))


class Agent:
    """Handle on a spawned agent process."""

    def __init__(self, transport: str) -> None:
        self.conn, child = CTX.Pipe()
        self.proc = CTX.Process(target=_agent_main, args=(child, transport), daemon=True)
        self.proc.start()
        self._lock = threading.Lock()

    def call(self, op: str, timeout: float = 60.0, **args) -> dict:
        with self._lock:
            self.conn.send_bytes(msgpack.packb({"op": op, "args": args}))
            assert self.conn.poll(timeout), f"agent did not answer {op} within {timeout}s"
            reply = msgpack.unpackb(self.conn.recv_bytes())
        assert reply.pop("ok"), reply["error"]
        return reply

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send_bytes(msgpack.packb({"op": "stop", "args": {}}))
                self.proc.join(10)
            except (BrokenPipeError, OSError):
                pass
        if self.proc.is_alive():
            self.kill()


@pytest.fixture(scope="module")
def agents(transport, local_nixl):
    """Two long-lived agents, plus some that a test may kill (all spawned in parallel)."""
    started = {name: Agent(transport) for name in ("a", "b", "doomed_sender",
                                                   "doomed_receiver", "stalled_sender",
                                                   "stopped_receiver")}
    yield started
    for agent in started.values():
        agent.stop()


@pytest.fixture
def receiver(local_nixl):
    sink = RecordingSink()
    rx = KVReceiver("127.0.0.1", 0, sink, TransferConfig(**FAST), nixl=local_nixl)
    rx.start()
    rx.sink = sink
    yield rx
    rx.close()


@pytest.fixture
def new_sender(local_nixl):
    """KVSender factory over the suite's transport; `peers` are (address, descriptor)."""
    made: list[KVSender] = []

    def make(config: TransferConfig, *peers: tuple[str, bytes]) -> KVSender:
        sender = KVSender(config, nixl=local_nixl)
        for address, peer in peers:
            sender.add_peer(address, peer)
        made.append(sender)
        return sender

    yield make
    for sender in made:
        sender.close()


def peer_of(rx) -> tuple[str, bytes]:
    """(address, landing pool descriptor) of a receiver, for `new_sender`."""
    t = target(rx)
    return t["address"], t["peer"]


def target(rx) -> dict:
    """The address and landing pool of a receiver (the in-process fixture or an agent's
    `receiver_start` answer), as arguments of an agent's send ops."""
    if isinstance(rx, dict):
        return {"address": rx["address"], "peer": rx["peer"]}
    return {"address": rx.address, "peer": rx.nixl_descriptor}


def pair_threads() -> list[str]:
    """Live pair threads of this process (send, back-channel and receive loops)."""
    return [t.name for t in threading.enumerate()
            if t.name.startswith(("kv-send ", "kv-back ", "kv-recv "))]


def wait_until(predicate, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


# ---- tests -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_round_trip_is_bit_exact(agents, receiver, dtype):
    layers, n = 4, 5
    rids = [f"rt-{dtype}-{i}" for i in range(3)]
    out = agents["a"].call("send_interleaved", **target(receiver), rids=rids,
                           layers=layers, n=n, dtype=dtype)
    nbytes = layers * n * math.prod(BLOCK_SHAPE) * DTYPES[dtype].itemsize
    assert out == {"layers": [layers] * 3, "bytes": [nbytes] * 3}
    for i, rid in enumerate(rids):
        assert receiver.sink.wait_for("done", rid)[2] == b"first %d" % i
        assert receiver.sink.kinds(rid) == ["layer"] * layers + ["done"]
        receiver.sink.assert_exact(rid, layers, n, DTYPES[dtype])
        assert receiver.state(rid) is TransferState.DONE
    stats = receiver.stats()
    assert stats["transfers_done"] == 3 and stats["transfers_failed"] == 0
    assert stats["bytes_received"] == 3 * nbytes


def test_two_senders_into_one_receiver_concurrently(agents, receiver):
    def run(agent: str) -> list[dict]:
        return [agents[agent].call("send", **target(receiver), rid=f"two-{agent}-{i}",
                                   layers=3, n=6, dtype="bfloat16") for i in range(3)]

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(run, ["a", "b"]))
    assert all(r["state"] == "done" for rs in results for r in rs), results
    for agent in ("a", "b"):
        for i in range(3):
            rid = f"two-{agent}-{i}"
            receiver.sink.wait_for("done", rid)
            receiver.sink.assert_exact(rid, 3, 6, torch.bfloat16)


def test_one_sender_to_two_receivers(agents, new_sender, transport):
    started = {name: agents[name].call("receiver_start", config=FAST) for name in ("a", "b")}
    addresses = {name: r["address"] for name, r in started.items()}
    sender = new_sender(TransferConfig(**FAST), *map(peer_of, started.values()))
    futures = {}
    for i in range(2):
        for name, address in addresses.items():  # interleave the two receivers
            rid = f"fan-{name}-{i}"
            for layer in range(3):
                sender.send_layer(address, rid, layer, make_blocks(rid, 4),
                                  make_kv(rid, layer, 4, torch.float32))
            futures[rid] = sender.finish(address, rid, bytes([i]))
    for future in futures.values():
        assert future.result(20).layers == 3
    assert sender.stats()["pairs_open"] == 2
    assert sender.stats()["pairs_nixl"] == (2 if transport == "nixl" else 0)
    # on one host the receivers read from the sender's staging pool (`nixl_read`)
    assert sender.stats()["pairs_nixl_reading"] == (2 if transport == "nixl" else 0)
    for name in ("a", "b"):
        for i in range(2):
            rid = f"fan-{name}-{i}"
            events = agents[name].call("events", kind="done", rid=rid)["events"]
            mine = [e for e in events if e[1] == rid]
            assert mine == [["layer", rid, 0, True], ["layer", rid, 1, True],
                            ["layer", rid, 2, True], ["done", rid, bytes([i])]]


def test_killed_sender_fails_its_transfer_on_the_receiver(agents, receiver):
    doomed = agents["doomed_sender"]
    doomed.call("send", **target(receiver), rid="orphan", layers=2, n=3,
                dtype="float32", finish=False)
    assert wait_until(lambda: receiver.sink.kinds("orphan").count("layer") == 2)
    doomed.kill()
    reason = receiver.sink.wait_for("failed", "orphan", timeout=5.0)[2]
    assert "broke" in reason
    assert "done" not in receiver.sink.kinds("orphan")
    assert receiver.state("orphan") is TransferState.FAILED
    assert wait_until(lambda: receiver.stats()["pairs_open"] == 0)
    assert wait_until(lambda: not pair_threads()), pair_threads()


def test_killed_receiver_fails_the_sender_future(agents, new_sender):
    doomed = agents["doomed_receiver"]
    started = doomed.call("receiver_start", config=FAST)
    address = started["address"]
    config = TransferConfig(io_timeout_s=5.0, **FAST)
    sender = new_sender(config, peer_of(started))
    sender.send_layer(address, "lost", 0, make_blocks("lost", 2),
                      make_kv("lost", 0, 2, torch.float32))
    assert doomed.call("events", kind="layer", rid="lost")["found"]
    doomed.kill()
    for layer in (1, 2):
        sender.send_layer(address, "lost", layer, make_blocks("lost", 2),
                          make_kv("lost", layer, 2, torch.float32))
    future = sender.finish(address, "lost", b"")
    with pytest.raises(TransferError, match="lost"):
        future.result(config.io_timeout_s + 5)
    assert sender.state("lost") is TransferState.FAILED
    assert sender.stats()["transfers_failed"] == 1
    sender.close()
    assert wait_until(lambda: not pair_threads()), pair_threads()


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def test_a_reader_killed_with_parts_unread_leaves_their_staging_slots_quarantined(
        agents, new_sender, local_nixl):
    """Parts in lent staging slots when their reader dies are not lent again at once (on
    another host a timed-out read could still land later); they come back when the
    quarantine (`io_timeout_s`) ends, and the pool serves the next receiver."""
    if local_nixl is None:
        pytest.skip("staging slots belong to NIXL reads")
    doomed = agents["stopped_receiver"]
    started = doomed.call("receiver_start", config=FAST)
    address = started["address"]
    slots = 8
    config = TransferConfig(io_timeout_s=4.0, nixl_pool_bytes=slots * 4096,
                            nixl_slot_bytes=4096, **FAST)  # 4 KiB: one 2-block fp32 layer
    sender = new_sender(config, peer_of(started))
    sender.send_layer(address, "stale", 0, make_blocks("stale", 2),
                      make_kv("stale", 0, 2, torch.float32))
    assert doomed.call("events", kind="layer", rid="stale")["found"]
    assert sender.stats()["pairs_nixl_reading"] == 1
    os.kill(doomed.proc.pid, signal.SIGSTOP)  # the reader stops: what follows stays unread
    assert wait_until(lambda: _stopped(doomed.proc.pid))
    for layer in (1, 2):
        sender.send_layer(address, "stale", layer, make_blocks("stale", 2),
                          make_kv("stale", layer, 2, torch.float32))
    assert wait_until(lambda: sender.stats()["nixl_staging_free"] <= slots - 2)
    future = sender.finish(address, "stale", b"")
    doomed.kill()
    with pytest.raises(TransferError, match="broke|lost"):
        future.result(config.io_timeout_s + 5)
    # the pair went down unclean: its unread slots are held, not free
    assert sender.stats()["nixl_staging_free"] <= slots - 2
    assert not local_nixl.connected(NixlDescriptor.decode(started["peer"]).metadata)
    assert wait_until(lambda: sender.stats()["nixl_staging_free"] == slots,
                      timeout=config.io_timeout_s + 10)
    live = agents["b"].call("receiver_start", config=FAST)
    sender.add_peer(live["address"], live["peer"])
    for layer in range(slots + 2):  # more layers than slots: every slot is lent again
        sender.send_layer(live["address"], "after", layer, make_blocks("after", 2),
                          make_kv("after", layer, 2, torch.float32))
    assert sender.finish(live["address"], "after", b"").result(20).layers == slots + 2
    assert agents["b"].call("events", kind="done", rid="after")["found"]
    events = [e for e in agents["b"].call("events")["events"] if e[1] == "after"]
    assert events == [["layer", "after", i, True] for i in range(slots + 2)] + [
        ["done", "after", b""]]  # in order, every byte as sent


def test_abort_fails_the_request_on_the_receiver_without_done(agents, receiver):
    out = agents["a"].call("send", **target(receiver), rid="cancelled", layers=2, n=3,
                           dtype="float32", abort="client cancelled")
    assert out["state"] == "failed"
    reason = receiver.sink.wait_for("failed", "cancelled")[2]
    assert "client cancelled" in reason
    time.sleep(0.2)  # a DONE, if one were (wrongly) sent, would have arrived by now
    assert "done" not in receiver.sink.kinds("cancelled")
    # the pair survives an abort: the next request on it completes
    out = agents["a"].call("send", **target(receiver), rid="after-abort", layers=1, n=2,
                           dtype="float32")
    assert out["state"] == "done"


def test_sink_error_fails_only_that_request(agents, receiver):
    def on_layer(request_id, layer, block_ids, kv, original=receiver.sink.on_layer):
        if request_id == "bad-sink" and layer == 1:
            raise RuntimeError("cache is full")
        original(request_id, layer, block_ids, kv)

    receiver.sink.on_layer = on_layer
    agents["a"].call("send", **target(receiver), rid="bad-sink", layers=3, n=2,
                     dtype="float32")
    assert "cache is full" in receiver.sink.wait_for("failed", "bad-sink")[2]
    assert receiver.sink.kinds("bad-sink") == ["layer", "failed"]
    out = agents["a"].call("send", **target(receiver), rid="good-sink", layers=3, n=2,
                           dtype="float32")
    assert out["state"] == "done"
    receiver.sink.wait_for("done", "good-sink")


def test_lease_expiry_fails_the_transfer_and_tells_the_receiver(agents, new_sender):
    started = agents["b"].call("receiver_start", config=FAST)
    address = started["address"]
    sender = new_sender(TransferConfig(lease_s=0.5, **FAST), peer_of(started))
    sender.send_layer(address, "slow", 0, make_blocks("slow", 2),
                      make_kv("slow", 0, 2, torch.float32))
    assert wait_until(lambda: sender.state("slow") is TransferState.FAILED, 10)
    with pytest.raises(TransferError, match="lease"):
        sender.finish(address, "slow", b"").result(1)
    assert sender.stats()["transfers_active"] == 0
    events = agents["b"].call("events", kind="failed", rid="slow")["events"]
    failed = [e for e in events if e[0] == "failed" and e[1] == "slow"]
    assert failed and "lease" in failed[0][2]


def test_a_stalled_sender_loses_its_request_on_the_receiver_when_the_lease_ends(agents,
                                                                              receiver):
    stalled = agents["stalled_sender"]
    stalled.call("send", **target(receiver), rid="stall", layers=1, n=2,
                 dtype="float32", finish=False, lease_s=1.0)
    receiver.sink.wait_for("layer", "stall")
    os.kill(stalled.proc.pid, signal.SIGSTOP)  # it can neither finish nor abort now
    try:
        reason = receiver.sink.wait_for("failed", "stall", timeout=10.0)[2]
    finally:
        os.kill(stalled.proc.pid, signal.SIGCONT)
    assert "lease" in reason and receiver.state("stall") is TransferState.FAILED
    # Back, the sender's own lease has run out too: its abort is dropped as late.
    assert stalled.call("state", rid="stall")["state"] == "failed"
    assert receiver.sink.kinds("stall") == ["layer", "failed"]


def test_header_with_unknown_version_closes_the_pair(agents, monkeypatch, new_sender):
    started = agents["b"].call("receiver_start", config=FAST)
    address = started["address"]
    sender = new_sender(TransferConfig(io_timeout_s=5.0, **FAST), peer_of(started))
    sender.send_layer(address, "v", 0, make_blocks("v", 2), make_kv("v", 0, 2, torch.float32))
    assert agents["b"].call("events", kind="layer", rid="v")["found"]
    real = wire.encode_header  # from now on the sender writes another version (and still
    monkeypatch.setattr(wire, "encode_header", lambda h: msgpack.packb(  # reads its own)
        {**msgpack.unpackb(real(h)), "v": wire.VERSION + 98}, use_bin_type=True))
    sender.send_layer(address, "v", 1, make_blocks("v", 2), make_kv("v", 1, 2, torch.float32))
    future = sender.finish(address, "v", b"")
    # The DONE may already sit in the receiver's posted frame buffer when it reads the bad
    # header (frames are pipelined, wire v7), so the sender may see it on the wire; what
    # counts is the receiver: it fails the request, never delivers the DONE, closes the pair.
    with contextlib.suppress(TransferError):
        future.result(10)
    assert wait_until(lambda: sender.stats()["pairs_open"] == 0)  # the sender saw it close
    sender.close()
    events = agents["b"].call("events", kind="failed", rid="v")["events"]
    failed = [e for e in events if e[0] == "failed" and e[1] == "v"]
    assert failed and "version" in failed[0][2]
    assert not any(e[0] == "done" for e in events)
    assert wait_until(lambda: agents["b"].call("receiver_stats")["stats"]["pairs_open"] == 0)


def test_hello_with_unknown_version_is_refused(receiver):
    host, port = receiver.address.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), None, False, timedelta(seconds=5))
    pair_id = store.add("pairs/next", 1)
    store.set(f"pairs/{pair_id}/hello", msgpack.packb({"v": 99, "kind": "hello"}))
    store.queue_push("pairs/hello", str(pair_id))
    store.wait([f"pairs/{pair_id}/reply"], timedelta(seconds=5))
    reply = msgpack.unpackb(store.get(f"pairs/{pair_id}/reply"))
    assert reply["v"] == wire.VERSION and reply["ok"] is False
    assert "version 99" in reply["reason"]
    assert receiver.stats()["pairs_open"] == 0


def test_pair_cap_evicts_lru_idle_pair_and_idle_pairs_close(agents, new_sender):
    rx_a = agents["a"].call("receiver_start", config=FAST)
    rx_b = agents["b"].call("receiver_start", config=FAST)
    addr_a, addr_b = rx_a["address"], rx_b["address"]

    def send(sender, address, rid, finish=True):
        sender.send_layer(address, rid, 0, make_blocks(rid, 2), make_kv(rid, 0, 2, torch.float32))
        return sender.finish(address, rid, b"") if finish else None

    sender = new_sender(TransferConfig(max_pairs=1, idle_timeout_s=0.5, **FAST),
                        peer_of(rx_a), peer_of(rx_b))
    send(sender, addr_a, "cap-1").result(10)
    send(sender, addr_b, "cap-2").result(10)  # evicts the idle pair to A
    assert sender.stats()["pairs_open"] == 1
    assert wait_until(lambda: agents["a"].call("receiver_stats")["stats"]["pairs_open"] == 0)
    send(sender, addr_b, "cap-busy", finish=False)  # the only pair is now busy
    with pytest.raises(TransferError, match="max_pairs"):
        send(sender, addr_a, "cap-3").result(10)
    sender.abort(addr_b, "cap-busy", "test")
    assert wait_until(lambda: sender.stats()["pairs_open"] == 0)  # idle timeout
    assert wait_until(lambda: agents["b"].call("receiver_stats")["stats"]["pairs_open"] == 0)
    assert send(sender, addr_a, "cap-4").result(10).layers == 1  # a fresh pair
    sender.close()
    for agent in ("a", "b"):
        events = agents[agent].call("events")["events"]
        failed = [e for e in events if e[0] == "failed"]
        assert failed == ([["failed", "cap-busy", "sender aborted: test"]] if agent == "b" else [])


def test_receiver_at_pair_cap_asks_its_lru_idle_pair_to_close(agents, local_nixl):
    sink = RecordingSink()
    with KVReceiver("127.0.0.1", 0, sink, TransferConfig(max_pairs=1, **FAST),
                    nixl=local_nixl) as rx:
        rx.start()
        for i, agent in enumerate(["a", "b", "a"]):  # each new sender evicts the previous pair
            out = agents[agent].call("send", **target(rx), rid=f"rcap-{i}", layers=2, n=2,
                                     dtype="float32")
            assert out["state"] == "done", out
            sink.wait_for("done", f"rcap-{i}")
            assert wait_until(lambda: rx.stats()["pairs_open"] == 1)
        assert not [e for e in sink.events if e[0] == "failed"]
        assert rx.stats()["transfers_failed"] == 0


def test_expected_request_that_never_arrives_fails(receiver):
    receiver.expect("never", timeout_s=0.3)
    assert receiver.state("never") is TransferState.PENDING
    assert "timed out" in receiver.sink.wait_for("failed", "never", timeout=5.0)[2]
    assert receiver.state("never") is TransferState.FAILED


# ---- what only the NIXL path does (run once per transport: trivially true over gloo) ---------

SLOTS = {"nixl_pool_bytes": 3 * 4096, "nixl_slot_bytes": 4096, "nixl_slots_per_pair": 2}
"""A tiny landing pool: 3 slots of 4 KiB (one block of BLOCK_SHAPE fp32 is 2 KiB)."""


def test_a_layer_larger_than_a_slot_lands_in_chunks_of_whole_blocks(agents, local_nixl):
    sink = RecordingSink()
    with KVReceiver("127.0.0.1", 0, sink, TransferConfig(**SLOTS, **FAST),
                    nixl=local_nixl) as rx:
        rx.start()
        agents["a"].call("send", **target(rx), rid="chunky", layers=2, n=7, dtype="float32")
        sink.wait_for("done", "chunky")
        sink.assert_exact("chunky", 2, 7, torch.float32)  # 7 blocks: 4 parts of <= 2 blocks
        calls = sink.kinds("chunky").count("layer")
        assert calls == (8 if local_nixl is not None else 2)
        if local_nixl is not None:
            assert rx.stats()["nixl_slots_free"] == 1  # the pair's 2 granted slots are held


@pytest.mark.parametrize("reads", [True, False])
def test_a_nixl_pair_that_reads_or_writes_lands_the_same_bytes(agents, local_nixl, reads):
    """`nixl_reads`: the receiver reads the sender's staging slots (one host), or the
    sender writes into the receiver's landing slots; both land exactly."""
    sink = RecordingSink()
    with KVReceiver("127.0.0.1", 0, sink, TransferConfig(**FAST), nixl=local_nixl) as rx:
        rx.start()
        rid = f"mode-{reads}"
        out = agents["a"].call("send", **target(rx), rid=rid, layers=3, n=5, dtype="bfloat16",
                               config={"nixl_reads": reads})
        assert out["state"] == "done", out
        sink.wait_for("done", rid)
        sink.assert_exact(rid, 3, 5, torch.bfloat16)
        stats = rx.stats()
        assert stats["bytes_received_nixl"] == (stats["bytes_received"] if local_nixl else 0)
        assert stats["pairs_nixl_reading"] == (1 if local_nixl is not None and reads else 0)
        read = stats["bytes_received"] if local_nixl is not None and reads else 0
        assert stats["bytes_read_nixl"] == read


def test_a_pair_the_pool_has_no_slots_for_sends_inline(agents, local_nixl):
    sink = RecordingSink()
    one_pair = {**SLOTS, "nixl_slots_per_pair": 3}  # the first pair takes the whole pool
    with KVReceiver("127.0.0.1", 0, sink, TransferConfig(**one_pair, **FAST),
                    nixl=local_nixl) as rx:
        rx.start()
        for agent in ("a", "b"):
            agents[agent].call("send", **target(rx), rid=f"pool-{agent}", layers=2, n=3,
                               dtype="bfloat16")
            sink.wait_for("done", f"pool-{agent}")
            sink.assert_exact(f"pool-{agent}", 2, 3, torch.bfloat16)
        assert rx.stats()["pairs_nixl"] == (1 if local_nixl is not None else 0)
        assert rx.stats()["transfers_failed"] == 0


def gate(rx, rid: str) -> tuple[threading.Event, threading.Event]:
    """Hold `rx`'s pair thread inside the sink at `rid`'s first layer (a slow receiver):
    (entered, release)."""
    entered, release = threading.Event(), threading.Event()

    def on_layer(request_id, layer, block_ids, kv, original=rx.sink.on_layer):
        if request_id == rid and not entered.is_set():
            entered.set()
            assert release.wait(30), "the test never released the receiver"
        original(request_id, layer, block_ids, kv)

    rx.sink.on_layer = on_layer
    return entered, release


def gated_receiver(local_nixl, slots_per_pair: int) -> KVReceiver:
    sink = RecordingSink()
    rx = KVReceiver("127.0.0.1", 0, sink, TransferConfig(
        nixl_pool_bytes=8 * 4096, nixl_slot_bytes=4096, nixl_slots_per_pair=slots_per_pair,
        **FAST), nixl=local_nixl)
    rx.sink = sink
    rx.start()
    return rx


def test_a_backlog_behind_a_slow_receiver_goes_out_coalesced_and_lands_exactly(
        agents, local_nixl):
    rx = gated_receiver(local_nixl, slots_per_pair=4)  # 4 KiB slots: a 2-block fp32 layer each
    try:
        entered, release = gate(rx, "backlog")
        agents["a"].call("send", **target(rx), rid="backlog", layers=8, n=2, dtype="float32",
                         finish=False)
        assert entered.wait(15)  # the receiver is stuck in layer 0; the rest queues up behind
        release.set()
        out = agents["a"].call("send", **target(rx), rid="backlog", layers=0, n=2,
                               dtype="float32", body=b"end")
        assert out["state"] == "done" and out["layers"] == 8, out
        assert rx.sink.wait_for("done", "backlog")[2] == b"end"
        assert rx.sink.kinds("backlog") == ["layer"] * 8 + ["done"]  # in order
        rx.sink.assert_exact("backlog", 8, 2, torch.float32)
        stats = rx.stats()
        assert stats["layer_parts"] == 8
        assert stats["layer_messages"] < 8, stats  # the backlog went out in BATCH messages
        assert stats["bytes_received_nixl"] == (stats["bytes_received"] if local_nixl else 0)
    finally:
        rx.close()


def test_a_slow_receiver_holds_a_nixl_sender_back_until_it_releases_slots(
        agents, local_nixl):
    rx = gated_receiver(local_nixl, slots_per_pair=2)
    try:
        entered, release = gate(rx, "held")
        agents["b"].call("send", **target(rx), rid="held", layers=4, n=2, dtype="float32",
                         finish=False)
        assert entered.wait(15)
        if local_nixl is not None:  # layers 0 and 1 hold both slots: layer 2 must wait
            assert wait_until(lambda: sum(s["nixl_slot_waits"] for s in agents["b"].call(
                "sender_stats")["stats"]) >= 1)
        release.set()
        out = agents["b"].call("send", **target(rx), rid="held", layers=0, n=2,
                               dtype="float32")
        assert out["state"] == "done" and out["layers"] == 4, out
        rx.sink.wait_for("done", "held")
        rx.sink.assert_exact("held", 4, 2, torch.float32)  # no slot overwritten too early
        assert rx.stats()["transfers_failed"] == 0
    finally:
        rx.close()


def test_a_malformed_landing_pool_descriptor_is_refused(new_sender):
    sender = new_sender(TransferConfig(**FAST))
    with pytest.raises(ValueError, match="NIXL descriptor"):
        sender.add_peer("127.0.0.1:1", b"\x81\xa1v\x09")
    sender.add_peer("127.0.0.1:1", b"")  # none: gloo to that receiver


# ---- NCCL (needs two CUDA devices) -----------------------------------------------------------

def _nccl_receiver_main(conn) -> None:
    torch.cuda.set_device(1)
    sink = AgentSink()
    rx = KVReceiver("127.0.0.1", 0, sink, TransferConfig(**FAST))
    rx.start()
    conn.send_bytes(msgpack.packb(rx.address))
    conn.recv_bytes()  # the test says when to report
    with sink.lock:
        conn.send_bytes(msgpack.packb([sink.events, sorted(sink.devices)]))
    rx.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs two CUDA devices")
def test_cuda_tensors_travel_over_nccl():
    conn, child = CTX.Pipe()
    proc = CTX.Process(target=_nccl_receiver_main, args=(child,), daemon=True)
    proc.start()
    try:
        assert conn.poll(60)
        address = msgpack.unpackb(conn.recv_bytes())
        with KVSender(TransferConfig(**FAST)) as sender:
            for layer in range(3):
                kv = make_kv("gpu", layer, 4, torch.bfloat16).cuda(0)
                sender.send_layer(address, "gpu", layer, make_blocks("gpu", 4), kv)
            assert sender.finish(address, "gpu", b"").result(60).layers == 3
        conn.send_bytes(b"report")
        assert conn.poll(30)
        events, devices = msgpack.unpackb(conn.recv_bytes())
        assert devices == ["cuda"]  # landed on the GPU: the payload went over NCCL
        assert [e for e in events if e[0] == "layer"] == [
            ["layer", "gpu", i, True] for i in range(3)]
    finally:
        proc.kill()
        proc.join(10)

