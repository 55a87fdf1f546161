"""GGUF tensors -> Hugging Face parameters: names, layout, types.

Names: llama.cpp's `blk.N.attn_q.weight` is `model.layers.N.self_attn.q_proj.weight`, and so on
(`HF_NAMES`). `rope_freqs.weight` is configuration, not a parameter (see gguf_config.py).

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

import re
from collections.abc import Sequence

import numpy as np
import torch

from pdserve.engine.checkpoint.gguf_int4 import INT4_TYPES, int4_from_blocks
from pdserve.engine.quant.int4_weight import Int4Weight

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_LINEAR = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
CONFIG_TENSORS = frozenset({"rope_freqs.weight"})
"""Tensors that describe the model rather than hold a parameter."""

# What the gguf package dequantises and these tests cover; anything else is refused by name.
SUPPORTED_TYPES = frozenset({
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
})
PERMUTED_ARCHITECTURES = frozenset({"llama", "mistral"})


def hf_name(gguf_name: str) -> str:
    """The Hugging Face parameter name of a GGUF tensor; ValueError for one the model lacks."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m is not None:
        layer, part, kind = m.groups()
        if part in _LINEAR:
            return f"model.layers.{layer}.{_LINEAR[part]}.{kind}"
        if part in _NORMS and kind == "weight":
            return f"model.layers.{layer}.{_NORMS[part]}.weight"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no place in a Llama/Qwen2/Mistral model")


def is_linear(gguf_name: str) -> bool:
    m = _BLOCK_RE.fullmatch(gguf_name)
    return m is not None and m.group(2) in _LINEAR and m.group(3) == "weight"


def rotary_heads(gguf_name: str, num_heads: int, num_kv_heads: int) -> int | None:
    """How many heads' rows llama.cpp interleaved in this tensor (None: not permuted)."""
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m is None:
        return None
    return {"attn_q": num_heads, "attn_k": num_kv_heads}.get(m.group(2))


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
