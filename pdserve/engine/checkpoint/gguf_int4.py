"""GGUF 4-bit blocks -> `Int4Weight`, by bit operations on the block bytes (never through floats).

Block layouts (ggml's `block_q4_0`, `block_q4_1`, `block_q4_K`; all little-endian):

    Q4_0  18 B / 32 values: d (f16), qs[16]      w = (q - 8) * d      -> scale d, offset -8d
    Q4_1  20 B / 32 values: d, m (f16), qs[16]   w = q * d + m        -> scale d, offset m
          value j of a block is qs[j] & 15, value j + 16 is qs[j] >> 4
    Q4_K  144 B / 256 values: d, dmin (f16), scales[12], qs[128]
          8 sub-blocks of 32 with 6-bit (sc, m) each: w = q * (d * sc) - dmin * m
                                                   -> group 32: scale d*sc, offset -dmin*m
          sub-blocks 2c and 2c+1 are the low and high nibbles of qs[32c : 32c + 32]

The scales come out as float32, computed the way `gguf.quants.dequantize` computes them, so
`Int4Weight.dequantize()` equals the package's dequantisation of the same tensor.
"""

from __future__ import annotations

import numpy as np
import torch

from pdserve.engine.quant.int4_weight import Int4Weight

INT4_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K"})
_BLOCK_BYTES = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144)}


def int4_from_blocks(data: np.ndarray, type_name: str, shape: tuple[int, int]) -> Int4Weight:
    """`data`: the tensor's bytes as the reader maps them, [rows, bytes per row] uint8."""
    if type_name not in INT4_TYPES:
        raise ValueError(f"{type_name} is not a 4-bit GGUF type ({sorted(INT4_TYPES)})")
    rows, cols = shape
    values, nbytes = _BLOCK_BYTES[type_name]
    if cols % values:
        raise ValueError(f"{cols} columns are not whole {type_name} blocks of {values}")
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, cols // values, nbytes)
    unpack = _q4_k if type_name == "Q4_K" else _q4_0_or_1
    q, scale, offset = unpack(blocks, type_name)
    return Int4Weight(torch.from_numpy(q.reshape(rows, cols)),
                      torch.from_numpy(scale.reshape(rows, -1)),
                      torch.from_numpy(offset.reshape(rows, -1)), group_size=32)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The f16 at byte `start` of every block, as float32 [rows, blocks]."""
    return np.ascontiguousarray(blocks[..., start:start + 2]).view(np.float16)[..., 0].astype(
        np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16 * k] bytes -> [..., k, 32] values: per 16 bytes, the low nibbles then the high."""
    qs = qs.reshape(*qs.shape[:-1], -1, 16)
    return np.concatenate((qs & 0x0F, qs >> 4), axis=-1)


def _q4_0_or_1(blocks: np.ndarray, type_name: str):
    d = _f16(blocks, 0)
    if type_name == "Q4_0":
        offset = d * np.float32(-8.0)
        qs = blocks[..., 2:18]
    else:
        offset = _f16(blocks, 2)
        qs = blocks[..., 4:20]
    return _nibbles(qs), d, offset


def _q4_k(blocks: np.ndarray, _type_name: str):
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    s = blocks[..., 4:16]
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    # Sub-blocks 0-3 keep 6 bits in bytes 0-7; 4-7 take 4 bits from bytes 8-11 and their top
    # 2 bits from the top of bytes 0-7.
    sc = np.concatenate((lo & 0x3F, (hi & 0x0F) | ((lo >> 6) << 4)), axis=-1)
    mins = np.concatenate((mid & 0x3F, (hi >> 4) | ((mid >> 6) << 4)), axis=-1)
    scale = d[..., None] * sc.astype(np.float32)
    offset = -(dmin[..., None] * mins.astype(np.float32))
    qs = blocks[..., 16:144].reshape(*blocks.shape[:-1], 4, 32)
    q = np.stack((qs & 0x0F, qs >> 4), axis=-2)  # [rows, blocks, 4 chunks, low/high, 32]
    return q, scale, offset
