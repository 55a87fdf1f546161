"""Chained, content-addressed block hashes: the one definition every process shares.

    h_0 = H(ROOT, extra, tokens of block 0)
    h_i = H(h_{i-1}, extra, tokens of block i)

`extra` binds a hash to everything else that changes the KV bytes (model id, KV dtype, ...), so
two models never share a block. The encoding is explicit little-endian bytes and BLAKE2b, so a
hash computed by the router equals the one computed by any worker on any machine. A hash names
a candidate only: a hit also compares the token ids, so a collision can never serve wrong KV.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

HASH_BYTES = 16
ROOT_HASH = bytes(HASH_BYTES)


def hash_extra(model_id: str, kv_dtype: str, block_size: int) -> bytes:
    """Digest of everything besides token ids that decides a block's KV contents."""
    material = f"{model_id}\0{kv_dtype}\0{block_size}".encode()
    return hashlib.blake2b(material, digest_size=HASH_BYTES).digest()


def block_hash(parent: bytes, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    h.update(parent)
    h.update(extra)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return h.digest()


def chain_hashes(
    token_ids: Sequence[int],
    block_size: int,
    extra: bytes = b"",
    parent: bytes = ROOT_HASH,
    start_block: int = 0,
) -> list[bytes]:
    """Hashes of the full blocks of `token_ids` from `start_block` on, chained from `parent`."""
    out: list[bytes] = []
    for start in range(start_block * block_size, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start:start + block_size], extra)
        out.append(parent)
    return out
