"""A GGUF file's architecture metadata -> `ModelConfig`.

llama.cpp writes the hyper-parameters under `<arch>.<key>` (`llama.block_count`, ...). Only the
architectures the engine's decoder implements are accepted; anything the file asks for that the
decoder does not do (a partial rotary, another rope scaling, per-layer head counts) is refused
with an error naming it rather than run wrong.

Which file-level facts come from the tensors rather than the metadata, as llama.cpp does it:
tied embeddings (no `output.weight`), attention / MLP biases (their tensors exist), and Llama
3.1's rope scaling (`rope_freqs.weight`, one divisor per rotary frequency).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pdserve.engine.model_config import ModelConfig, RopeConfig

# general.architecture -> engine family. llama.cpp converts Mistral models as "llama".
ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}


def model_config_from_gguf(meta: Mapping[str, Any], tensor_shapes: Mapping[str, Sequence[int]],
                           freq_factors: Sequence[float] = (), torch_dtype: str = "float32",
                           eos_token_ids: Sequence[int] = ()) -> ModelConfig:
    """The engine's config for a file with this metadata and these tensors (name -> shape in
    Hugging Face order). `freq_factors` is the content of `rope_freqs.weight` if the file has
    one."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: "
                         f"{', '.join(sorted(ARCHITECTURES))})")
    family = ARCHITECTURES[arch]
    key = _Keys(meta, arch)
    hidden = key.integer("embedding_length")
    num_heads = key.integer("attention.head_count")
    head_dim = key.integer("attention.key_length", hidden // num_heads)
    if key.integer("attention.value_length", head_dim) != head_dim:
        raise ValueError(f"GGUF {arch}.attention.value_length differs from key_length "
                         f"({head_dim}): not supported")
    rotary = key.integer("rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise ValueError(f"GGUF {arch}.rope.dimension_count = {rotary} (partial rotary over a "
                         f"head of {head_dim}) is not supported")
    names = set(tensor_shapes)
    attn_bias = "blk.0.attn_q.bias" in names
    if "token_embd.weight" not in names:
        raise ValueError("GGUF file has no token_embd.weight")
    vocab = tensor_shapes["token_embd.weight"][0]  # what the model has, whatever the metadata
    return ModelConfig(
        family=family,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=key.integer("feed_forward_length"),
        num_layers=key.integer("block_count"),
        num_heads=num_heads,
        num_kv_heads=key.integer("attention.head_count_kv", num_heads),
        head_dim=head_dim,
        max_position_embeddings=key.integer("context_length", 2048),
        rms_norm_eps=float(key.get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope=_rope(key, freq_factors),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias=family == "qwen2" or attn_bias,
        o_bias="blk.0.attn_output.bias" in names,
        mlp_bias="blk.0.ffn_gate.bias" in names,
        sliding_window=_sliding_window(key, family),
        torch_dtype=torch_dtype,
        eos_token_ids=tuple(eos_token_ids),
    )


class _Keys:
    """`<arch>.<name>` lookups with type checks; a per-layer array is refused."""

    def __init__(self, meta: Mapping[str, Any], arch: str) -> None:
        self.meta, self.arch = meta, arch

    def get(self, name: str, default: Any = None) -> Any:
        value = self.meta.get(f"{self.arch}.{name}", default)
        if isinstance(value, (list, tuple)):
            if len(set(value)) != 1:
                raise ValueError(f"GGUF {self.arch}.{name} varies per layer ({list(value)[:4]}"
                                 "...): not supported")
            value = value[0]
        return value

    def integer(self, name: str, default: int | None = None) -> int:
        value = self.get(name, default)
        if value is None:
            raise ValueError(f"GGUF file lacks {self.arch}.{name}")
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"GGUF {self.arch}.{name} must be a positive integer, got {value!r}")
        return value


def _rope(key: _Keys, freq_factors: Sequence[float]) -> RopeConfig:
    theta = float(key.get("rope.freq_base", 10000.0))
    scaling = key.get("rope.scaling.type", "none") or "none"
    if freq_factors and scaling not in ("none", "linear"):
        raise ValueError(f"GGUF rope_freqs.weight with {key.arch}.rope.scaling.type "
                         f"{scaling!r} is not supported")
    if scaling == "linear":
        factor = float(key.get("rope.scaling.factor", 1.0))
        return RopeConfig(theta, "linear", (("factor", factor),), tuple(freq_factors))
    if scaling != "none":
        raise ValueError(f"GGUF {key.arch}.rope.scaling.type {scaling!r} is not supported "
                         "(supported: none, linear, and rope_freqs.weight)")
    return RopeConfig(theta, "default", (), tuple(float(f) for f in freq_factors))


def _sliding_window(key: _Keys, family: str) -> int | None:
    window = key.get("attention.sliding_window")
    if window is None:
        return None
    if family != "mistral":
        raise ValueError(f"GGUF {key.arch}.attention.sliding_window is only supported for "
                         "the mistral architecture")
    return int(window)
