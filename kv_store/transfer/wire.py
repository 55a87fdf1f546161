"""Wire format of the transfer engine: versioned msgpack control messages and payload dtypes.

One message on a pair is a frame of tensors sent in order on the same tag:

    int64[1] header length  →  uint8[length] msgpack header  →  payload tensor ("layer" only)

The header is a msgpack map `{"v": VERSION, "kind": ..., ...}`; nothing is ever pickled. The
payload moves as a raw tensor in its "carrier" dtype (fp8 travels as its uint8 bytes, since the
collective backends do not know fp8). The rendezvous hello/reply documents use the same
`pack`/`unpack` and therefore carry the version too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import msgpack
import torch

VERSION = 3
# Protocol version history (bump on any incompatible change of framing, kinds or fields):
#   1 — first version: length tensor + msgpack header + payload; kinds layer/done/abort/close;
#       rendezvous hello/reply through the receiver's TCPStore.
#   2 — layer headers carry `head_start`: the global index of the payload's first KV head, so
#       a slice of heads can travel between groups of different tensor-parallel degrees.
#   3 — authenticated pairs (`auth`): hello and reply may carry `nonce` and `mac`; on a pair
#       opened that way every header is preceded by a 32-byte HMAC over (sequence, header).

MAX_HEADER_BYTES = 1 << 20
"""Largest header accepted; a larger length tensor means a corrupt or foreign stream."""

# name on the wire -> (dtype seen by callers, dtype moved by the backend)
_DTYPES: dict[str, tuple[torch.dtype, torch.dtype]] = {
    "float32": (torch.float32, torch.float32),
    "bfloat16": (torch.bfloat16, torch.bfloat16),
    "float16": (torch.float16, torch.float16),
    "float8_e4m3fn": (torch.float8_e4m3fn, torch.uint8),
    "uint8": (torch.uint8, torch.uint8),
}
_NAMES = {dtype: name for name, (dtype, _) in _DTYPES.items()}


class ProtocolError(RuntimeError):
    """A message that this side cannot accept: wrong version, malformed or out of bounds."""


class Kind(Enum):
    LAYER = "layer"
    DONE = "done"
    ABORT = "abort"
    CLOSE = "close"


@dataclass(frozen=True)
class Header:
    """One decoded control message; which fields matter depends on `kind`."""

    kind: Kind
    rid: str = ""
    layer: int = -1
    blocks: tuple[int, ...] = ()
    shape: tuple[int, ...] = ()
    dtype: str = ""
    head_start: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    reason: str = ""


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


def encode_header(h: Header) -> bytes:
    doc: dict[str, Any] = {"kind": h.kind.value}
    if h.kind is not Kind.CLOSE:
        doc["rid"] = h.rid
    if h.kind is Kind.LAYER:
        doc.update(layer=h.layer, blocks=list(h.blocks), shape=list(h.shape), dtype=h.dtype,
                   head_start=h.head_start)
    elif h.kind is Kind.DONE:
        doc["meta"] = h.meta
    else:
        doc["reason"] = h.reason
    return pack(doc)


def decode_header(data: bytes) -> Header:
    """Inverse of `encode_header`, validating every field (`ProtocolError` names the field)."""
    doc = unpack(data)
    try:
        kind = Kind(doc.get("kind"))
    except ValueError:
        raise ProtocolError(f"unknown message kind {doc.get('kind')!r}") from None
    if kind is Kind.CLOSE:
        return Header(kind, reason=_field(doc, "reason", str))
    rid = _field(doc, "rid", str)
    if not rid:
        raise ProtocolError("field 'rid' is empty")
    if kind is Kind.DONE:
        return Header(kind, rid=rid, meta=_field(doc, "meta", dict))
    if kind is Kind.ABORT:
        return Header(kind, rid=rid, reason=_field(doc, "reason", str))
    return _decode_layer(doc, rid)


def _decode_layer(doc: dict[str, Any], rid: str) -> Header:
    layer = _field(doc, "layer", int)
    blocks = tuple(_field(doc, "blocks", list))
    shape = tuple(_field(doc, "shape", list))
    dtype = _field(doc, "dtype", str)
    head_start = _field(doc, "head_start", int) if "head_start" in doc else 0
    if head_start < 0:
        raise ProtocolError(f"field 'head_start' is negative: {head_start}")
    if layer < 0:
        raise ProtocolError(f"field 'layer' is negative: {layer}")
    if not all(isinstance(b, int) and b >= 0 for b in blocks):
        raise ProtocolError("field 'blocks' must hold non-negative ints")
    if not shape or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ProtocolError(f"field 'shape' must be non-negative ints, got {shape}")
    if shape[0] != len(blocks):
        raise ProtocolError(f"field 'shape' {shape} does not match {len(blocks)} blocks")
    if dtype not in _DTYPES:
        raise ProtocolError(f"field 'dtype' {dtype!r} is not one of {sorted(_DTYPES)}")
    return Header(Kind.LAYER, rid=rid, layer=layer, blocks=blocks, shape=shape, dtype=dtype,
                  head_start=head_start)


def _field(doc: dict[str, Any], name: str, kind: type) -> Any:
    value = doc.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ProtocolError(f"field {name!r} must be {kind.__name__}, got {type(value).__name__}")
    return value


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of a payload dtype; `ValueError` for dtypes the engine does not move."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(f"kv dtype {dtype} is not one of {sorted(_DTYPES)}") from None


def to_carrier(kv: torch.Tensor) -> torch.Tensor:
    """Contiguous tensor in the dtype the backend moves (a view, or a copy if non-contiguous)."""
    kv = kv.contiguous()
    carrier = _DTYPES[dtype_name(kv.dtype)][1]
    return kv if kv.dtype == carrier else kv.view(carrier)


def empty_carrier(shape: tuple[int, ...], name: str, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=_DTYPES[name][1], device=device)


def from_carrier(buf: torch.Tensor, name: str) -> torch.Tensor:
    dtype = _DTYPES[name][0]
    return buf if buf.dtype == dtype else buf.view(dtype)


def payload_nbytes(shape: tuple[int, ...], name: str) -> int:
    return math.prod(shape) * _DTYPES[name][1].itemsize
