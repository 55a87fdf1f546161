"""Pair rendezvous through the receiver's TCPStore: who may open a pair, and under which id.

Keys in the receiver's store:

    pairs/next          counter; `add` gives every new pair a unique id
    pairs/hello         queue of pair ids waiting for the receiver's answer
    pairs/<id>/hello    the sender's `Hello` (versioned msgpack)
    pairs/<id>/reply    the receiver's `Reply` (versioned msgpack)
    pairs/<id>/pg/      prefix under which both ends build the pair's process groups

Sender: add → set hello → push id → wait for the reply → build its end (rank 1).
Receiver: pop id → read hello → answer → build its end (rank 0). A hello in a foreign protocol
version is answered with a refusal that names both versions.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from kv_store.transfer import wire
from kv_store.transfer.wire import ProtocolError

_NEXT = "pairs/next"
_QUEUE = "pairs/hello"


@dataclass(frozen=True)
class Hello:
    """What a sender tells the receiver about a pair it wants to open."""

    sender: str
    """Human-readable sender identity ("host:pid"), for logs and failure reasons."""
    host: str
    """Address the sender's gloo device listens on."""
    transport: str
    """"gloo" (control and payload over gloo) or "nccl" (payloads over NCCL)."""
    quiet_limit_s: float
    """Longest silence of a healthy sender on this pair; the receiver gives up after it."""


@dataclass(frozen=True)
class Reply:
    ok: bool
    reason: str = ""


def parse_address(address: str) -> tuple[str, int]:
    """Split "host:port" (IPv6 hosts in brackets); `ValueError` names the field."""
    if not isinstance(address, str) or ":" not in address:
        raise ValueError(f"address must be 'host:port', got {address!r}")
    host, _, port_text = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"address must be 'host:port' with a port in 1..65535, got {address!r}")
    return host, int(port_text)


def local_host_for(peer_host: str) -> str:
    """The local address this machine uses to reach `peer_host` (no packet is sent)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(peer_host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(sockaddr)
        return probe.getsockname()[0]


def connect(address: str, timeout_s: float) -> dist.TCPStore:
    host, port = parse_address(address)
    return dist.TCPStore(host, port, None, False, timedelta(seconds=timeout_s))


def offer(store: dist.Store, hello: Hello, timeout_s: float) -> tuple[int, Reply]:
    """Sender side: register a pair and wait for the receiver's answer."""
    pair_id = store.add(_NEXT, 1)
    store.set(f"pairs/{pair_id}/hello", wire.pack({
        "kind": "hello", "sender": hello.sender, "host": hello.host,
        "transport": hello.transport, "quiet_limit_s": hello.quiet_limit_s,
    }))
    store.queue_push(_QUEUE, str(pair_id))
    key = f"pairs/{pair_id}/reply"
    store.wait([key], timedelta(seconds=timeout_s))
    doc = wire.unpack(store.get(key))
    return pair_id, Reply(ok=bool(doc.get("ok")), reason=str(doc.get("reason", "")))


def poll(store: dist.Store) -> list[tuple[int, Hello | ProtocolError]]:
    """Receiver side: the pairs offered since the last call (never blocks)."""
    offered: list[tuple[int, Hello | ProtocolError]] = []
    while True:
        try:
            pair_id = int(store.queue_pop(_QUEUE, block=False))
        except dist.QueueEmptyError:
            return offered
        try:
            offered.append((pair_id, _decode_hello(store.get(f"pairs/{pair_id}/hello"))))
        except ProtocolError as exc:
            offered.append((pair_id, exc))


def _decode_hello(data: bytes) -> Hello:
    doc = wire.unpack(data)
    transport = doc.get("transport")
    if transport not in ("gloo", "nccl"):
        raise ProtocolError(f"hello field 'transport' must be gloo or nccl, got {transport!r}")
    limit = doc.get("quiet_limit_s")
    if not isinstance(limit, int | float) or limit <= 0:
        raise ProtocolError(f"hello field 'quiet_limit_s' must be positive, got {limit!r}")
    sender, host = doc.get("sender"), doc.get("host")
    if not isinstance(sender, str) or not isinstance(host, str) or not host:
        raise ProtocolError("hello fields 'sender' and 'host' must be strings")
    return Hello(sender=sender, host=host, transport=transport, quiet_limit_s=float(limit))


def answer(store: dist.Store, pair_id: int, reply: Reply) -> None:
    store.set(f"pairs/{pair_id}/reply", wire.pack({"kind": "reply", "ok": reply.ok,
                                                   "reason": reply.reason}))


def pair_store(store: dist.Store, pair_id: int) -> dist.Store:
    return dist.PrefixStore(f"pairs/{pair_id}/pg/", store)
