"""Authentication of transfer pairs: a receiver accepts KV only from senders that hold the
cluster's KV key, and each end accepts only frames the other end sealed, in order.

The receiver's TCPStore has no access control: any local process can read and write its keys.
So nothing read from it is trusted without a MAC (HMAC-SHA256) under `key`, the KV key derived
from the cluster secret (`pdserve.serving.security.secret.KV_PURPOSE`):

    sender                                             receiver
      hello{pair id, sender, host, transport, quiet limit, nonce_s}  + MAC(key)  ──►
                                                  checks the MAC and that the id is new
      ◄──  reply{ok, reason, nonce_r}  + MAC(key) over the reply and nonce_s
    pair key K = HMAC(key, pair id | nonce_s | nonce_r), one per direction

    every header on the pair:  MAC(K_dir, seq | header bytes) ‖ header{..., "seq": n}
    the reader refuses a wrong MAC or any seq but the next one (no replay, no reordering,
    no frame from a pair that another process hijacked at the gloo rendezvous)

Payload tensors follow their sealed header and are not MAC'd: their shape, dtype, layer,
blocks and request id are, and the bytes move in the clear over gloo/NCCL (the data network
must be private: docs/architecture.md, "Security").

A pair key proves that a frame comes from *some* holder of the cluster secret. Which request
it may write into is proved by the request's ticket: a random key that the receiving worker
makes when it reserves the blocks, and hands out only over the authenticated gRPC hand-off
(`DecodeReady.kv_ticket` ─► router ─► `KVTarget.kv_ticket` / `PushKVRequest.kv_ticket`):

    header{rid, layer, blocks, ..., lease_s, tag = HMAC(ticket, every other field)}

The receiver checks the tag against the ticket it holds for that request now, so a cluster
member that was not handed this transfer, or a late frame of an earlier transfer of the same
request id (another ticket), is refused. The ticket itself never travels on the data network.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
from dataclasses import dataclass

import msgpack

from kv_store.transfer.wire import Header, ProtocolError

MAC_BYTES = 32
NONCE_BYTES = 16
TICKET_BYTES = 16


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def _mac(key: bytes, *parts: bytes | str | int | float | bool) -> bytes:
    h = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:  # length-prefixed, so no two field lists give the same bytes
        data = part if isinstance(part, bytes) else repr(part).encode()
        h.update(len(data).to_bytes(4, "big") + data)
    return h.digest()


def hello_mac(key: bytes, pair_id: int, sender: str, host: str, transport: str,
              quiet_limit_s: float, nonce: bytes) -> bytes:
    return _mac(key, b"hello", pair_id, sender, host, transport, float(quiet_limit_s), nonce)


def reply_mac(key: bytes, pair_id: int, ok: bool, reason: str, sender_nonce: bytes,
              nonce: bytes) -> bytes:
    return _mac(key, b"reply", pair_id, bool(ok), reason, sender_nonce, nonce)


def verify(expected: bytes, given: object, what: str) -> None:
    if not isinstance(given, bytes) or not hmac.compare_digest(expected, given):
        raise ProtocolError(f"{what}: missing or wrong MAC (not signed with the cluster "
                            "secret)")


@dataclass(frozen=True)
class PairKeys:
    """The two directions' keys of one pair."""

    forward: bytes
    """Sender → receiver frames."""
    backward: bytes
    """Receiver → sender frames (close requests)."""

    @classmethod
    def derive(cls, key: bytes, pair_id: int, sender_nonce: bytes, receiver_nonce: bytes
               ) -> PairKeys:
        base = _mac(key, b"pair", pair_id, sender_nonce, receiver_nonce)
        return cls(_mac(base, b"forward"), _mac(base, b"backward"))


class Sealer:
    """Seals the frames of one direction (one writer): MAC(seq ‖ header) ‖ header."""

    def __init__(self, key: bytes) -> None:
        self._key = key
        self._seq = 0

    def seal(self, header: bytes) -> bytes:
        self._seq += 1
        return _mac(self._key, self._seq, header) + header


class Opener:
    """Checks the frames of one direction: the MAC, computed with the next sequence number,
    so a replayed, dropped or reordered frame fails like a forged one."""

    def __init__(self, key: bytes) -> None:
        self._key = key
        self._seq = 0

    def open(self, frame: bytes) -> bytes:
        """The header bytes of a sealed frame (`ProtocolError` if it does not verify)."""
        if len(frame) <= MAC_BYTES:
            raise ProtocolError("sealed frame too short")
        mac, header = frame[:MAC_BYTES], frame[MAC_BYTES:]
        verify(_mac(self._key, self._seq + 1, header), mac, f"frame {self._seq + 1}")
        self._seq += 1
        return header


@dataclass(frozen=True)
class FrameAuth:
    """What one end of a pair seals its frames with, and opens its peer's with."""

    sealer: Sealer
    opener: Opener

    @classmethod
    def for_end(cls, keys: PairKeys, sender: bool) -> FrameAuth:
        if sender:
            return cls(Sealer(keys.forward), Opener(keys.backward))
        return cls(Sealer(keys.backward), Opener(keys.forward))


def new_ticket() -> bytes:
    """A fresh ticket for one transfer (made by whoever reserves the blocks it fills)."""
    return os.urandom(TICKET_BYTES)


def check_ticket(ticket: bytes) -> None:
    """`ValueError` unless `ticket` is b"" (an unbound transfer) or a ticket-sized key."""
    if not isinstance(ticket, bytes) or len(ticket) not in (0, TICKET_BYTES):
        raise ValueError(f"a ticket must be b'' or {TICKET_BYTES} bytes, got "
                         f"{len(ticket) if isinstance(ticket, bytes) else type(ticket).__name__}")


def ticket_tag(ticket: bytes, h: Header) -> bytes:
    """HMAC of every field of `h` but `tag`, under `ticket`."""
    return _mac(ticket, b"ticket", h.kind.value, h.rid, h.layer,
                msgpack.packb(list(h.blocks)), msgpack.packb(list(h.shape)), h.dtype,
                h.head_start, bytes(h.body), h.reason, float(h.lease_s))


def tagged(h: Header, ticket: bytes) -> Header:
    """`h` with its tag under `ticket` (unchanged for an unbound transfer: b"")."""
    return dataclasses.replace(h, tag=ticket_tag(ticket, h)) if ticket else h


def tag_matches(ticket: bytes, h: Header) -> bool:
    """True if `h` was tagged under `ticket` (constant time)."""
    return bool(ticket) and hmac.compare_digest(ticket_tag(ticket, h), h.tag)
