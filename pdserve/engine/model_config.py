"""The model's architecture, read from a Hugging Face `config.json`.

One frozen dataclass owns every architectural number the runtime needs, so layers never read
raw dicts. Both config spellings are accepted: transformers<5 (`rope_theta` + `rope_scaling`) and
transformers>=5 (`rope_parameters`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.engine.moe_config import MoEConfig, moe_config_from_dict

if TYPE_CHECKING:
    import torch

# architecture name -> family; the family decides the few structural differences.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
_MLA_FAMILIES = ("deepseek_v2", "deepseek_v3")
_QWEN = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")

_DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
           "half": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16"}
"""Accepted spellings -> torch's name: the dtype is looked up only when parsed, so reading a
checkpoint's configuration (the router does) needs no torch."""


def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    import torch

    if isinstance(value, torch.dtype):
        return value
    if value not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {value!r}")
    return getattr(torch, _DTYPES[value])


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters.

    `rope_type` is "default", "linear", "llama3" or "yarn"; `params` holds the type's own
    numeric fields (factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings; yarn: beta_fast, beta_slow, mscale, mscale_all_dim,
    attention_factor, truncate as 1.0 / 0.0).
    """

    theta: float = 10000.0
    rope_type: str = "default"
    params: tuple[tuple[str, float], ...] = ()
    freq_factors: tuple[float, ...] = ()
    """One divisor per rotary frequency (head_dim / 2 of them), applied after the schedule:
    how GGUF files state Llama 3.1's scaling (`rope_freqs.weight`). Empty: none."""

    def get(self, key: str, default: float | None = None) -> float | None:
        return dict(self.params).get(key, default)


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention numbers (DeepSeek-V2 / V2-Lite / V3), as the configs name
    them. Keys and values of every head are up-projections of one latent per token."""

    kv_lora_rank: int
    """Width of the latent c_KV: what the cache holds per token (plus the rope key)."""
    qk_nope_head_dim: int
    """Per-head query/key width without rotary (the part absorbed into the latent)."""
    qk_rope_head_dim: int
    """Width of the rotary part: per head for queries, one shared key per token."""
    v_head_dim: int
    q_lora_rank: int | None = None
    """Queries through a low-rank bottleneck (V2, V3); None: one projection (V2-Lite)."""
    rope_interleave: bool = True
    """Rotary pairs are interleaved (x0, x1), (x2, x3), ... (V2 always; V3 unless the config
    says `rope_interleave: false`, then the NeoX halves)."""

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"MLA {name} must be positive, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer (Llama-shaped attention)."""

    family: str  # a value of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 always; Llama when attention_bias
    o_bias: bool = False  # Llama attention_bias also biases o_proj
    mlp_bias: bool = False
    sliding_window: int | None = None  # keys older than this many positions are masked
    torch_dtype: str = "float32"  # the checkpoint's dtype
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k before rotary
    moe: MoEConfig | None = None  # the sparse MLP blocks of a mixture-of-experts model
    mla: MLAConfig | None = None  # latent attention (then num_kv_heads is 1: the latent,
    # and head_dim the query/key head width qk_nope + qk_rope)
    num_mtp_layers: int = 0  # DeepSeek-V3 multi-token-prediction layers after the decoder

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        family = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES),
                      None)
        if family is None:
            family = cfg.get("model_type")
        if family not in SUPPORTED_ARCHITECTURES.values():
            raise ValueError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        mla = _mla_from_dict(family, cfg)
        num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
        if mla is not None:
            head_dim, num_kv_heads = mla.qk_head_dim, 1
        attention_bias = bool(cfg.get("attention_bias", False))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            family=family,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(head_dim),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=_rope_from_dict(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=_qkv_bias(family, cfg, attention_bias),
            o_bias=family not in ("qwen2", "qwen2_moe") and attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            sliding_window=_sliding_window(family, cfg),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            eos_token_ids=eos_ids,
            qk_norm=family in ("qwen3", "qwen3_moe"),
            moe=moe_config_from_dict(family, cfg),
            mla=mla,
            num_mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0)
            if family == "deepseek_v3" else 0,
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"model_path has no config.json: {model_dir}")
        return cls.from_dict(json.loads(path.read_text()))


def _rope_from_dict(cfg: dict[str, Any]) -> RopeConfig:
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params.update(scaling)
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", params.pop("type", "default")) or "default"
    if rope_type not in ("default", "linear", "llama3", "yarn"):
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported")
    if rope_type == "yarn":
        if "original_max_position_embeddings" not in params:
            raise ValueError("yarn rope scaling needs original_max_position_embeddings")
        if params.get("factor") is None:  # DeepSeek-V3 style: the ratio of the lengths
            params["factor"] = (float(cfg.get("max_position_embeddings", 2048))
                                / float(params["original_max_position_embeddings"]))
        if isinstance(params.get("truncate"), bool):
            params["truncate"] = float(params["truncate"])
    numeric = tuple(sorted((k, float(v)) for k, v in params.items()
                           if isinstance(v, (int, float)) and not isinstance(v, bool)))
    return RopeConfig(theta=theta, rope_type=rope_type, params=numeric)


def _mla_from_dict(family: str, cfg: dict[str, Any]) -> MLAConfig | None:
    if family not in _MLA_FAMILIES:
        return None
    q_rank = cfg.get("q_lora_rank")
    return MLAConfig(
        kv_lora_rank=int(cfg["kv_lora_rank"]), qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
        qk_rope_head_dim=int(cfg["qk_rope_head_dim"]), v_head_dim=int(cfg["v_head_dim"]),
        q_lora_rank=None if q_rank is None else int(q_rank),
        # transformers' V2 always interleaves; V3 reads the flag (default true).
        rope_interleave=family == "deepseek_v2" or bool(cfg.get("rope_interleave", True)))


def _qkv_bias(family: str, cfg: dict[str, Any], attention_bias: bool) -> bool:
    if family == "qwen2":
        return True
    if family == "qwen2_moe":  # released checkpoints omit the flag and have the biases
        return bool(cfg.get("qkv_bias", True))
    return attention_bias


def _sliding_window(family: str, cfg: dict[str, Any]) -> int | None:
    window = cfg.get("sliding_window")
    if window is None:
        return None
    if family == "qwen3_moe":  # one window for every layer, when enabled
        return int(window) if cfg.get("use_sliding_window", False) and window else None
    if family in _QWEN:
        # Qwen2 applies the window only when asked, and only to some layers; we support the
        # common case (no sliding layers) and refuse the rest rather than be silently wrong.
        layer_types = cfg.get("layer_types") or []
        if not cfg.get("use_sliding_window", False) or "sliding_attention" not in layer_types:
            return None
        raise ValueError(f"{family} sliding-window layers are not supported")
    return int(window)
