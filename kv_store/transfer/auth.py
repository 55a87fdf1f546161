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
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass

from kv_store.transfer.wire import ProtocolError

MAC_BYTES = 32
NONCE_BYTES = 16


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
