"""What the DONE marker of a KV transfer says: typed, frozen messages with one msgpack codec.

The transfer engine carries a DONE's `body` as opaque bytes (`kv_store.transfer.wire`); these
are the only bodies the workers send:

    PrefillDone  prefill rank 0 → decode rank 0: the prompt's KV is all sent; the first token
    PartsDone    every other (prefill rank, decode rank) pair: that pair sent all its parts
    PullDone     pushing worker → every decode rank of a pull: how many leading blocks of the
                 range were sent (the rest will not come)

Each body is a msgpack map `{"v": VERSION, "type": ..., ...}`; `decode` checks every field
and raises `MessageError` naming the one that is wrong. Nothing is ever pickled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgpack

VERSION = 1
# History: 1 - first version; replaces the untyped DONE map of transfer wire v2, whose
#              meaning depended on which keys it had ("token_id" vs "pull_blocks").


class MessageError(ValueError):
    """A DONE body that is not one of these messages (foreign version, bad field)."""


@dataclass(frozen=True)
class PrefillDone:
    """The prefill worker computed the whole prompt and sampled the first token."""

    token_id: int
    logprob: float | None = None
    """Its log-probability, when the request asked for logprobs."""
    sampled_at: float = 0.0
    """Wall-clock time (Unix seconds) it was sampled: the decode worker measures how long
    its KV took to land after that (the exposed part of the transfer)."""


@dataclass(frozen=True)
class PartsDone:
    """One (prefill rank, decode rank) pair sent every part it had for the request."""


@dataclass(frozen=True)
class PullDone:
    """A pushing worker sent the first `blocks` blocks of the pulled range."""

    blocks: int


Done = PrefillDone | PartsDone | PullDone
_TYPES = {PrefillDone: "prefill", PartsDone: "parts", PullDone: "pull"}


def encode(msg: Done) -> bytes:
    doc: dict[str, Any] = {"v": VERSION, "type": _TYPES[type(msg)]}
    if isinstance(msg, PrefillDone):
        doc.update(token_id=msg.token_id, logprob=msg.logprob, sampled_at=msg.sampled_at)
    elif isinstance(msg, PullDone):
        doc["blocks"] = msg.blocks
    return msgpack.packb(doc, use_bin_type=True)


def decode(data: bytes) -> Done:
    try:
        doc = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise MessageError(f"undecodable DONE body: {exc}") from None
    if not isinstance(doc, dict):
        raise MessageError("DONE body is not a map")
    if doc.get("v") != VERSION:
        raise MessageError(f"DONE body version {doc.get('v')!r}; this side speaks {VERSION}")
    kind = doc.get("type")
    if kind == "prefill":
        logprob = doc.get("logprob")
        if logprob is not None and not isinstance(logprob, float):
            raise MessageError("field 'logprob' must be a float or nil")
        sampled_at = _field(doc, "sampled_at", float)
        if not math.isfinite(sampled_at):
            raise MessageError("field 'sampled_at' must be finite")
        return PrefillDone(_count(doc, "token_id"), logprob, sampled_at)
    if kind == "parts":
        return PartsDone()
    if kind == "pull":
        return PullDone(_count(doc, "blocks"))
    raise MessageError(f"unknown DONE type {kind!r}")


def _field(doc: dict[str, Any], name: str, kind: type) -> Any:
    value = doc.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise MessageError(f"field {name!r} must be {kind.__name__}, "
                           f"got {type(value).__name__}")
    return value


def _count(doc: dict[str, Any], name: str) -> int:
    value = _field(doc, name, int)
    if value < 0:
        raise MessageError(f"field {name!r} is negative: {value}")
    return value
