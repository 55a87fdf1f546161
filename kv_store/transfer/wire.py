"""Wire format of the transfer engine: versioned msgpack control messages and payload dtypes.

One message on a pair is a frame of tensors sent in order on the same tag:

    int64[1] header length  →  uint8[length] msgpack header  →  payload tensor ("layer" only)

A LAYER whose `slot` is set carries no payload tensor: its bytes were written into that slot
of the receiver's NIXL landing pool before the header was sent (`nixl_path`) or, on a pair
whose sender sent an OFFER, they wait in that slot of the sender's staging pool for the
receiver to read (`nixl_read`); the receiver publishes how many slot parts it has copied out
(or read) in a credit counter of its pool, which the sender reads.

A BATCH coalesces several LAYER messages that were ready at once into one frame: its header
holds the LAYER headers (`parts`, each tagged under its own transfer's ticket), and the
payloads of the parts without a slot follow it, in order:

    int64[1] length  →  uint8[length] BATCH{parts}  →  payload of each inline part, in order

The header is a msgpack map `{"v": VERSION, "kind": ..., ...}` decoded into one frozen
`Header`; nothing is ever pickled. The payload moves as a raw tensor in its "carrier" dtype
(fp8 travels as its uint8 bytes, since the collective backends do not know fp8). The
rendezvous hello/reply documents use the same `pack`/`unpack` and therefore carry the version
too. What a DONE says is opaque here: `body` bytes that the transfer's users encode with their
own versioned codec (`pdserve.serving.kv_messages`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import msgpack

VERSION = 9
# Protocol version history (bump on any incompatible change of framing, kinds or fields):
#   1 — first version: length tensor + msgpack header + payload; kinds layer/done/abort/close;
#       rendezvous hello/reply through the receiver's TCPStore.
#   2 — layer headers carry `head_start`: the global index of the payload's first KV head, so
#       a slice of heads can travel between groups of different tensor-parallel degrees.
#   3 — taken by two branches at once, each without the other's change, so no 3 speaks to
#       the other 3:
#       (security) authenticated pairs (`auth`): hello and reply may carry `nonce` and `mac`;
#       on a pair opened that way every header is preceded by a 32-byte HMAC over (sequence,
#       header).
#       (lifecycle) DONE carries opaque `body` bytes (a typed message of the layer above)
#       instead of a msgpack map; layer and DONE headers carry `lease_s`, what is left of the
#       transfer's lease, so the receiver gives up on a request when its sender does.
#   4 — both version-3 changes together: sealed headers (on authenticated pairs) whose LAYER
#       and DONE carry `lease_s`, DONE an opaque `body`.
#   5 — LAYER, DONE and ABORT carry `tag`: an HMAC of the header's other fields under the
#       transfer's ticket, the random key the decode worker handed out with its reservation
#       over the authenticated RPC (`auth.ticket_tag`); empty for a transfer without one.
#   6 — NIXL payloads: LAYER carries `slot` (-1: the payload tensor follows on the pair; >= 0:
#       its bytes are already in that slot of the receiver's landing pool), a new GRANT kind
#       (receiver → sender) hands `slots` to the sender, and a hello may name transport
#       "nixl".
#   7 — BATCH kind: several LAYER headers (`parts`) in one frame, their inline payloads
#       following in order, so layers that are ready together cost one message (and, over
#       NIXL, one write and one GRANT) instead of one each. A v6 peer is refused at its hello.
#   8 — NIXL credits: a pair gets one GRANT, at its start, whose `credit` names a counter in
#       the receiver's landing pool; the sender writes its slots in the GRANT's (ring) order
#       and reads how many parts the receiver has released from that counter (a NIXL READ)
#       instead of waiting for a GRANT back per message. A second GRANT is a protocol error.
#   9 — NIXL reads: an OFFER kind (sender → receiver, at most once, before the pair's first
#       slot part) names the sender's staging pool (`body`: its `NixlDescriptor`); from then
#       on a LAYER's `slot` names a slot of that pool, which the receiver reads straight into
#       its paged cache (`nixl_read`). The credit counter is unchanged.

MAX_BODY_BYTES = 64 << 10
"""Largest DONE body: it names a token or a count, never bulk data."""

MAX_TAG_BYTES = 64
"""Largest `tag` accepted (the tags made here are 32 bytes)."""

MAX_HEADER_BYTES = 1 << 20
"""Largest header accepted; a larger length tensor means a corrupt or foreign stream."""

MAX_OFFER_BYTES = MAX_HEADER_BYTES - (4 << 10)
"""Largest OFFER body (a NIXL descriptor: agent metadata and the pool's layout)."""

# name on the wire -> (name of the dtype the backend moves, bytes per element). The tensors
# themselves are viewed in `carrier`: this module (framing) needs no torch.
DTYPES: dict[str, tuple[str, int]] = {
    "float32": ("float32", 4),
    "bfloat16": ("bfloat16", 2),
    "float16": ("float16", 2),
    "float8_e4m3fn": ("uint8", 1),
    "uint8": ("uint8", 1),
}


class ProtocolError(RuntimeError):
    """A message that this side cannot accept: wrong version, malformed or out of bounds."""


class Kind(Enum):
    LAYER = "layer"
    DONE = "done"
    ABORT = "abort"
    CLOSE = "close"
    GRANT = "grant"
    BATCH = "batch"
    OFFER = "offer"


@dataclass(frozen=True)
class Header:
    """One decoded control message; which fields matter depends on `kind`:

        LAYER  rid, layer, blocks, shape, dtype, head_start, lease_s, tag, slot
               (a payload tensor follows unless `slot` >= 0)
        DONE   rid, body, lease_s, tag
        ABORT  rid, reason, tag
        CLOSE  reason
        GRANT  slots, credit  (receiver → sender, once: the pair's landing slots, in the
               order they are written, and where their release counter is)
        BATCH  parts  (LAYER headers; the payloads of those without a slot follow)
        OFFER  body  (sender → receiver, at most once: the sender's staging pool, as a
               `NixlDescriptor`)
    """

    kind: Kind
    rid: str = ""
    layer: int = -1
    blocks: tuple[int, ...] = ()
    shape: tuple[int, ...] = ()
    dtype: str = ""
    head_start: int = 0
    body: bytes = b""
    reason: str = ""
    lease_s: float = 0.0
    """Seconds left of the request's lease when the message was queued (LAYER, DONE)."""
    tag: bytes = b""
    """HMAC of the fields above under the request's ticket (`auth.ticket_tag`; LAYER, DONE,
    ABORT); b"" for a transfer that has no ticket."""
    slot: int = -1
    """LAYER: the landing slot that already holds the payload (-1: it follows inline). Not
    under the ticket's tag: it says where this pair put the bytes, and the pair seals it."""
    slots: tuple[int, ...] = ()
    """GRANT: the pair's landing slots, in the order the sender writes them (a ring)."""
    credit: int = -1
    """GRANT: address, in the receiver's process, of the pool's counter of this pair's slot
    parts released (-1: no slots)."""
    parts: tuple[Header, ...] = ()
    """BATCH: its LAYER messages, in the order they were queued."""


def pack(doc: dict[str, Any]) -> bytes:
    """msgpack a control document, stamping the protocol version."""
    return msgpack.packb({"v": VERSION, **doc}, use_bin_type=True)


def unpack(data: bytes) -> dict[str, Any]:
    """Decode a control document; raise `ProtocolError` on a foreign version or bad shape."""
    try:
        doc = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise ProtocolError(f"undecodable control message: {exc}") from exc
    if not isinstance(doc, dict):
        raise ProtocolError("control message is not a map")
    version = doc.get("v")
    if version != VERSION:
        raise ProtocolError(
            f"unsupported protocol version {version!r} (this side speaks {VERSION})")
    return doc


MAX_GRANT_SLOTS = 1024
"""Most slots one GRANT may name."""

MAX_BATCH_PARTS = 64
"""Most LAYER parts one BATCH may hold."""

MAX_BATCH_BLOCKS = 32768
"""Most block ids a BATCH's parts may name together (keeps its header far below
`MAX_HEADER_BYTES`: a block id takes at most 5 bytes)."""


def batch(parts: tuple[Header, ...]) -> Header:
    """One message for `parts` (LAYER headers): the part itself when there is only one."""
    if not parts or any(p.kind is not Kind.LAYER for p in parts):
        raise ValueError("a batch holds one or more LAYER headers")
    if len(parts) > MAX_BATCH_PARTS:
        raise ValueError(f"a batch holds at most {MAX_BATCH_PARTS} parts, got {len(parts)}")
    if len(parts) > 1 and sum(len(p.blocks) for p in parts) > MAX_BATCH_BLOCKS:
        raise ValueError(f"a batch names at most {MAX_BATCH_BLOCKS} blocks")
    return parts[0] if len(parts) == 1 else Header(Kind.BATCH, parts=tuple(parts))


def layers_of(h: Header) -> tuple[Header, ...]:
    """The LAYER headers a LAYER or BATCH message carries, in order."""
    return h.parts if h.kind is Kind.BATCH else (h,)


def encode_header(h: Header) -> bytes:
    if h.kind is Kind.GRANT:
        return pack({"kind": h.kind.value, "slots": list(h.slots), "credit": h.credit})
    if h.kind is Kind.OFFER:
        return pack({"kind": h.kind.value, "body": bytes(h.body)})
    if h.kind is Kind.BATCH:
        return pack({"kind": h.kind.value, "parts": [_doc(p) for p in h.parts]})
    return pack(_doc(h))


def _doc(h: Header) -> dict[str, Any]:
    """The fields of a LAYER, DONE, ABORT or CLOSE header (without the version)."""
    doc: dict[str, Any] = {"kind": h.kind.value}
    if h.kind is not Kind.CLOSE:
        doc["rid"] = h.rid
    if h.kind is Kind.LAYER:
        doc.update(layer=h.layer, blocks=list(h.blocks), shape=list(h.shape), dtype=h.dtype,
                   head_start=h.head_start, lease_s=float(h.lease_s), slot=h.slot)
    elif h.kind is Kind.DONE:
        doc.update(body=bytes(h.body), lease_s=float(h.lease_s))
    else:
        doc["reason"] = h.reason
    if h.kind is not Kind.CLOSE:
        doc["tag"] = bytes(h.tag)
    return doc


def decode_header(data: bytes) -> Header:
    """Inverse of `encode_header`, validating every field (`ProtocolError` names the field)."""
    doc = unpack(data)
    try:
        kind = Kind(doc.get("kind"))
    except ValueError:
        raise ProtocolError(f"unknown message kind {doc.get('kind')!r}") from None
    if kind is Kind.CLOSE:
        return Header(kind, reason=_field(doc, "reason", str))
    if kind is Kind.OFFER:
        body = _field(doc, "body", bytes)
        if not body or len(body) > MAX_OFFER_BYTES:
            raise ProtocolError(f"an OFFER needs a descriptor of 1..{MAX_OFFER_BYTES} bytes")
        return Header(kind, body=body)
    if kind is Kind.GRANT:
        slots = _slots(doc)
        credit = _field(doc, "credit", int)
        if credit < -1 or (credit == -1) != (not slots):
            raise ProtocolError(f"field 'credit' must be an address with slots, -1 without, "
                                f"got {credit}")
        return Header(kind, slots=slots, credit=credit)
    if kind is Kind.BATCH:
        return _decode_batch(doc)
    rid, tag = _rid_and_tag(doc)
    if kind is Kind.DONE:
        body = _field(doc, "body", bytes)
        if len(body) > MAX_BODY_BYTES:
            raise ProtocolError(f"field 'body' has {len(body)} bytes (max {MAX_BODY_BYTES})")
        return Header(kind, rid=rid, body=body, lease_s=_lease(doc), tag=tag)
    if kind is Kind.ABORT:
        return Header(kind, rid=rid, reason=_field(doc, "reason", str), tag=tag)
    return _decode_layer(doc, rid, tag)


def _slots(doc: dict[str, Any]) -> tuple[int, ...]:
    slots = tuple(_field(doc, "slots", list))
    if len(slots) > MAX_GRANT_SLOTS or not _naturals(slots):
        raise ProtocolError(f"field 'slots' must be at most {MAX_GRANT_SLOTS} "
                            "non-negative ints")
    return slots


def _decode_batch(doc: dict[str, Any]) -> Header:
    parts = _field(doc, "parts", list)
    if not 2 <= len(parts) <= MAX_BATCH_PARTS:
        raise ProtocolError(f"field 'parts' must hold 2..{MAX_BATCH_PARTS} headers, "
                            f"got {len(parts)}")
    out = []
    for part in parts:
        if not isinstance(part, dict) or part.get("kind") != Kind.LAYER.value:
            raise ProtocolError("field 'parts' must hold LAYER headers only")
        out.append(_decode_layer(part, *_rid_and_tag(part)))
    return Header(Kind.BATCH, parts=tuple(out))


def _rid_and_tag(doc: dict[str, Any]) -> tuple[str, bytes]:
    rid = _field(doc, "rid", str)
    if not rid:
        raise ProtocolError("field 'rid' is empty")
    tag = _field(doc, "tag", bytes) if "tag" in doc else b""  # absent: an unbound transfer
    if len(tag) > MAX_TAG_BYTES:
        raise ProtocolError(f"field 'tag' has {len(tag)} bytes (max {MAX_TAG_BYTES})")
    return rid, tag


def _decode_layer(doc: dict[str, Any], rid: str, tag: bytes) -> Header:
    layer = _field(doc, "layer", int)
    blocks = tuple(_field(doc, "blocks", list))
    shape = tuple(_field(doc, "shape", list))
    dtype = _field(doc, "dtype", str)
    head_start = _field(doc, "head_start", int) if "head_start" in doc else 0
    if head_start < 0:
        raise ProtocolError(f"field 'head_start' is negative: {head_start}")
    if layer < 0:
        raise ProtocolError(f"field 'layer' is negative: {layer}")
    if not _naturals(blocks):
        raise ProtocolError("field 'blocks' must hold non-negative ints")
    if not shape or not _naturals(shape):
        raise ProtocolError(f"field 'shape' must be non-negative ints, got {shape}")
    if shape[0] != len(blocks):
        raise ProtocolError(f"field 'shape' {shape} does not match {len(blocks)} blocks")
    if dtype not in DTYPES:
        raise ProtocolError(f"field 'dtype' {dtype!r} is not one of {sorted(DTYPES)}")
    slot = _field(doc, "slot", int) if "slot" in doc else -1
    if slot < -1:
        raise ProtocolError(f"field 'slot' must be -1 or a slot index, got {slot}")
    return Header(Kind.LAYER, rid=rid, layer=layer, blocks=blocks, shape=shape, dtype=dtype,
                  head_start=head_start, lease_s=_lease(doc), tag=tag, slot=slot)


def _naturals(values: Sequence[Any]) -> bool:
    """Every value a non-negative int. A bool is an int to `isinstance`, so a header naming
    block `true` passed as block 1 before; exact types are checked here."""
    return not values or (set(map(type, values)) == {int} and min(values) >= 0)


def _lease(doc: dict[str, Any]) -> float:
    lease = _field(doc, "lease_s", float)
    if not math.isfinite(lease):
        raise ProtocolError(f"field 'lease_s' is not finite: {lease}")
    return lease


def _field(doc: dict[str, Any], name: str, kind: type) -> Any:
    value = doc.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ProtocolError(f"field {name!r} must be {kind.__name__}, got {type(value).__name__}")
    return value


def payload_nbytes(shape: tuple[int, ...], name: str) -> int:
    return math.prod(shape) * DTYPES[name][1]
