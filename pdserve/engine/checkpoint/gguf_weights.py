"""GGUF tensors -> Hugging Face parameters: layout and types (names: gguf_names.py).

Layout: a GGUF 2-D tensor of dims [ne0, ne1] is stored row-major as ne1 rows of ne0 values, which
is exactly `nn.Linear`'s [out_features, in_features]: no transpose. llama.cpp's converter
permutes the rows of q and k for the `llama` architecture (Mistral included) so that each
head's rotary pairs are interleaved (GPT-J layout); `hf_row_order` is the permutation that
undoes it, as transformers' GGUF loader does. Qwen2 files are not permuted.

Types: dense tensors are dequantised to float32 with the `gguf` package. With `prefer_int4`,
linear weights stored as Q4_0 / Q4_1 / Q4_K come out as `Int4Weight` straight from their block
bytes (gguf_int4.py); the same row permutation applies to them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pdserve.engine.checkpoint.gguf_int4 import INT4_TYPES, int4_from_blocks
from pdserve.engine.quant.int4_weight import Int4Weight


def hf_row_order(rows: int, heads: int) -> torch.Tensor:
    """Index of the GGUF row each HF row comes from: per head, llama.cpp stored rotary pair
    (i, i + d/2) as rows (2i, 2i + 1); HF keeps the halves apart."""
    if rows % (2 * heads):
        raise ValueError(f"{rows} rows do not split into {heads} heads of rotary pairs")
    half = rows // heads // 2
    return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(-1)


def dense(data: np.ndarray, type_name: str, shape: Sequence[int]) -> torch.Tensor:
    """A tensor's values as float32 in HF shape (rows = ne1, cols = ne0)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    values = gguf.quants.dequantize(np.asarray(data), qtype)
    # Copy: the reader's memory map is read-only, and a parameter must own its storage.
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(tuple(shape)))


def load_tensor(data: np.ndarray, type_name: str, shape: Sequence[int], *, linear: bool,
                prefer_int4: bool, permute_heads: int | None
                ) -> torch.Tensor | Int4Weight:
    """One GGUF tensor as the model takes it: dense float32, or an `Int4Weight`."""
    if prefer_int4 and linear and type_name in INT4_TYPES:
        weight: torch.Tensor | Int4Weight = int4_from_blocks(np.asarray(data), type_name,
                                                             tuple(shape))
    else:
        weight = dense(data, type_name, shape)
    if permute_heads is not None:
        order = hf_row_order(shape[0], permute_heads)
        weight = (weight.permute_rows(order) if isinstance(weight, Int4Weight)
                  else weight.index_select(0, order))
    return weight
