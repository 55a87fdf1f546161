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

With a KV key (`TransferConfig.auth_key`) the hello and the reply carry a nonce and a MAC
(`auth`): anyone can write these keys, so the receiver accepts only hellos signed for their
own pair id, the sender only a signed reply, and both derive the pair's frame keys from the
two nonces.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from kv_store.transfer import auth, wire
from kv_store.transfer.auth import PairKeys
from kv_store.transfer.wire import ProtocolError

TRANSPORTS = ("gloo", "nccl", "nixl")
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
    """"gloo" (control and payload over gloo), "nccl" (payloads over NCCL) or "nixl"
    (payloads written into the receiver's landing pool: `nixl_path`)."""
    quiet_limit_s: float
    """Longest silence of a healthy sender on this pair; the receiver gives up after it."""
    nonce: bytes = b""
    """The sender's random contribution to the pair's keys (authenticated pairs)."""
    mac: bytes = b""
    """HMAC of the fields above and the pair id under the KV key (authenticated pairs)."""

    def signed(self, key: bytes, pair_id: int) -> Hello:
        nonce = auth.new_nonce()
        return Hello(self.sender, self.host, self.transport, self.quiet_limit_s, nonce,
                     auth.hello_mac(key, pair_id, self.sender, self.host, self.transport,
                                    self.quiet_limit_s, nonce))

    def check(self, key: bytes, pair_id: int) -> None:
        """`ProtocolError` unless this hello was signed with `key` for `pair_id`."""
        auth.verify(auth.hello_mac(key, pair_id, self.sender, self.host, self.transport,
                                   self.quiet_limit_s, self.nonce), self.mac,
                    f"hello of pair {pair_id}")


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


def offer(store: dist.Store, hello: Hello, timeout_s: float, key: bytes | None = None
          ) -> tuple[int, Reply, PairKeys | None]:
    """Sender side: register a pair and wait for the receiver's answer; with `key`, sign the
    hello, check the reply's signature and derive the pair's keys."""
    pair_id = store.add(_NEXT, 1)
    if key is not None:
        hello = hello.signed(key, pair_id)
    doc = {"kind": "hello", "sender": hello.sender, "host": hello.host,
           "transport": hello.transport, "quiet_limit_s": hello.quiet_limit_s}
    if key is not None:
        doc.update(nonce=hello.nonce, mac=hello.mac)
    store.set(f"pairs/{pair_id}/hello", wire.pack(doc))
    store.queue_push(_QUEUE, str(pair_id))
    reply_key = f"pairs/{pair_id}/reply"
    store.wait([reply_key], timedelta(seconds=timeout_s))
    doc = wire.unpack(store.get(reply_key))
    reply = Reply(ok=bool(doc.get("ok")), reason=str(doc.get("reason", "")))
    if key is None:
        return pair_id, reply, None
    nonce = doc.get("nonce")
    auth.verify(auth.reply_mac(key, pair_id, reply.ok, reply.reason, hello.nonce,
                               nonce if isinstance(nonce, bytes) else b""),
                doc.get("mac"), f"reply to pair {pair_id}")
    return pair_id, reply, PairKeys.derive(key, pair_id, hello.nonce, nonce)


def poll(store: dist.Store) -> list[tuple[int, Hello | ProtocolError]]:
    """Receiver side: the pairs offered since the last call (never blocks). Anyone can push
    to the queue, so an entry that is not a pair id, or whose hello is not in the store (a
    sender writes its hello before it pushes its id), is skipped: waiting for it would stall
    every real offer behind it."""
    offered: list[tuple[int, Hello | ProtocolError]] = []
    while True:
        try:
            entry = store.queue_pop(_QUEUE, block=False)
        except dist.QueueEmptyError:
            return offered
        try:
            pair_id = int(entry)
        except ValueError:
            continue
        key = f"pairs/{pair_id}/hello"
        if not store.check([key]):
            continue
        try:
            offered.append((pair_id, _decode_hello(store.get(key))))
        except ProtocolError as exc:
            offered.append((pair_id, exc))


def _decode_hello(data: bytes) -> Hello:
    doc = wire.unpack(data)
    transport = doc.get("transport")
    if transport not in TRANSPORTS:
        raise ProtocolError(f"hello field 'transport' must be one of {TRANSPORTS}, got "
                            f"{transport!r}")
    limit = doc.get("quiet_limit_s")
    if not isinstance(limit, int | float) or limit <= 0:
        raise ProtocolError(f"hello field 'quiet_limit_s' must be positive, got {limit!r}")
    sender, host = doc.get("sender"), doc.get("host")
    if not isinstance(sender, str) or not isinstance(host, str) or not host:
        raise ProtocolError("hello fields 'sender' and 'host' must be strings")
    nonce, mac = doc.get("nonce", b""), doc.get("mac", b"")
    if not isinstance(nonce, bytes) or not isinstance(mac, bytes):
        raise ProtocolError("hello fields 'nonce' and 'mac' must be bytes")
    return Hello(sender=sender, host=host, transport=transport, quiet_limit_s=float(limit),
                 nonce=nonce, mac=mac)


def answer(store: dist.Store, pair_id: int, reply: Reply, key: bytes | None = None,
           sender_nonce: bytes = b"", nonce: bytes = b"") -> None:
    """Receiver side: write the reply; with `key`, signed over the sender's nonce and ours
    (`nonce`, which the pair's keys were derived from: `PairKeys.derive`)."""
    doc = {"kind": "reply", "ok": reply.ok, "reason": reply.reason}
    if key is not None:
        nonce = nonce or auth.new_nonce()
        doc.update(nonce=nonce, mac=auth.reply_mac(key, pair_id, reply.ok, reply.reason,
                                                    sender_nonce, nonce))
    store.set(f"pairs/{pair_id}/reply", wire.pack(doc))


def pair_store(store: dist.Store, pair_id: int) -> dist.Store:
    return dist.PrefixStore(f"pairs/{pair_id}/pg/", store)
