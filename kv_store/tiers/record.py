"""The SSD tier's on-disk record: one block, versioned and checksummed.

    record = header (struct `<4sBBH16sQI`: magic, version, checksum kind, n_tokens, hash,
             checksum, data_len) + token ids (int32 x n_tokens) + block bytes (opaque)

The checksum covers the token ids and the block bytes, which lie contiguous after the header,
so a reader checks a record with one pass over one buffer and no copy. The kind byte names
the algorithm that wrote it: xxh3-64 (the `xxhash` package, about ten times zlib's crc32 on
these machines) where that package is installed, crc32 otherwise; a reader verifies with the
kind the record names, and a record whose kind it cannot compute fails (a miss, recomputed).

Version history (the layout of every record in a segment file):
  1 — header `<4sBxH16sII`: crc32 (zlib) of tokens + bytes. No longer read: such a record is
      refused like any other layout (a persisted tier skips it at start-up, drops segments
      with nothing usable, and the engine recomputes those blocks).
  2 — a checksum-kind byte in the old pad byte, and a 64-bit checksum (xxh3-64 or crc32).
      The hash stays at offset 8 and the checksum follows it.
"""

from __future__ import annotations

import enum
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

try:
    import xxhash
except ImportError:  # the tier still works, with the slower checksum
    xxhash = None

MAGIC = b"PDKV"
VERSION = 2
HEADER = struct.Struct("<4sBBH16sQI")


class Checksum(enum.IntEnum):
    """Checksum algorithms a record may name (the header's kind byte)."""

    CRC32 = 1
    XXH3_64 = 2


WRITE_CHECKSUM = Checksum.XXH3_64 if xxhash is not None else Checksum.CRC32


@dataclass(frozen=True)
class RecordHeader:
    """What a record's header says about it (its layout already checked against ours)."""

    block_hash: bytes
    tokens: tuple[int, ...]


def record_bytes(block_size: int, block_bytes: int) -> int:
    return HEADER.size + 4 * block_size + block_bytes


def checksum(kind: Checksum, parts: Sequence[memoryview | bytes]) -> int | None:
    """The checksum of `parts` in order, or None when this process cannot compute `kind`."""
    if kind is Checksum.XXH3_64 and xxhash is not None:
        h = xxhash.xxh3_64()
        for p in parts:
            h.update(p)
        return h.intdigest()
    if kind is Checksum.CRC32:
        crc = 0
        for p in parts:
            crc = zlib.crc32(p, crc)
        return crc
    return None


def encode(block_hash: bytes, tokens: tuple[int, ...], data: bytes) -> list[bytes]:
    """A record as the buffers to write in order (header, tokens, data: no joined copy)."""
    tok = np.asarray(tokens, dtype="<i4").tobytes()
    digest = checksum(WRITE_CHECKSUM, (tok, data))
    header = HEADER.pack(MAGIC, VERSION, WRITE_CHECKSUM, len(tokens), block_hash, digest,
                         len(data))
    return [header, tok, data]


def parse_header(raw: bytes, block_size: int, block_bytes: int) -> RecordHeader | None:
    """Hash and token ids of a record's header + tokens, if it has this layout and version."""
    if len(raw) < HEADER.size + 4 * block_size:
        return None
    magic, version, _kind, n, h, _sum, length = HEADER.unpack_from(raw)
    if (magic, version, n, length) != (MAGIC, VERSION, block_size, block_bytes):
        return None
    tok = np.frombuffer(raw, dtype="<i4", count=block_size, offset=HEADER.size)
    return RecordHeader(h, tuple(tok.tolist()))


def decode(raw: memoryview, block_hash: bytes, tokens: tuple[int, ...],
           block_bytes: int) -> memoryview | None:
    """The block bytes of a record (a view into `raw`), or None if it fails a check."""
    n_tok = 4 * len(tokens)
    if len(raw) != HEADER.size + n_tok + block_bytes:
        return None
    magic, version, kind, n, h, digest, length = HEADER.unpack_from(raw)
    if (magic, version, n, h, length) != (MAGIC, VERSION, len(tokens), block_hash, block_bytes):
        return None
    try:
        kind = Checksum(kind)
    except ValueError:
        return None
    body = raw[HEADER.size:]
    if checksum(kind, (body,)) != digest:
        return None
    if np.frombuffer(body, dtype="<i4", count=len(tokens)).tolist() != list(tokens):
        return None
    return body[n_tok:]
