"""GGUF tensor names -> Hugging Face parameter names, and which tensors are what.

llama.cpp's `blk.N.attn_q.weight` is `model.layers.N.self_attn.q_proj.weight`, and so on.
`rope_freqs.weight` is configuration, not a parameter (see gguf_config.py). No torch here: a
checkpoint's configuration and tokenizer are read (by the router too) without loading weights
(gguf_weights.py).
"""

from __future__ import annotations

import re

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
