"""EAGLE and EAGLE-3 draft heads, in the checkpoint layouts vLLM loads.

EAGLE (`"method": "eagle"`): a Llama-config directory whose weights are `fc.weight`
[H, 2H] (+ `fc.bias`) and decoder layers `layers.<i>.*` (layer 0 without an input norm);
any `embed_tokens.weight` is ignored and the LM head is the target's.

    h = fc([embed(x_{i+1}), f_i]) ─► decoder layers ─► out = hidden + residual
    logits = target lm_head(out); the next chained step feeds `out` as its feature

f_i is the target's final hidden state (after its norm) at position i.

EAGLE-3 (`"method": "eagle3"`): `fc.weight` [H, 3 * target H] fusing the residual stream
entering three target layers (`eagle_config.eagle_aux_hidden_state_layer_ids`, default
(2, L / 2, L - 3)), one decoder layer `midlayer.*` (or `layers.0.*`) whose attention reads
[input_layernorm(embed), hidden_norm(feature)] (2H wide), `norm.weight`, its own
`lm_head.weight` over `draft_vocab_size` tokens mapped to target ids by `d2t` (target id =
draft id + d2t[draft id]; `t2d` is ignored), an optional `embed_tokens.weight`.

    logits = lm_head(norm(pre)) scattered into the target vocabulary; the next chained step
    feeds `pre` (before the final norm) as its feature
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.kv_layout import KVLayout
from pdserve.engine.layers.linear import QKVParallelLinear
from pdserve.engine.layers.norm import RMSNorm
from pdserve.engine.layers.rotary import RotaryEmbedding
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.models.llama import MLP, Attention
from pdserve.engine.parallel import SINGLE
from pdserve.engine.quant.kv_format import KVCacheFormat
from pdserve.engine.spec.features import FeatureSpec, StepFeatures
from pdserve.engine.spec.heads.base import DraftHead, load_into


def head_model_config(raw: dict[str, Any]) -> ModelConfig:
    """The head's own Llama-shaped numbers (its config.json, whatever architecture it names)."""
    return ModelConfig.from_dict({**raw, "architectures": ["LlamaForCausalLM"],
                                  "model_type": "llama"})


class _Layer(nn.Module):
    """A Llama decoder layer that passes its residual on (vLLM's fused-add convention)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, rotary: RotaryEmbedding,
                 input_norm: bool, attn_in: int | None = None) -> None:
        super().__init__()
        if input_norm:
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype, SINGLE, rotary)
        if attn_in is not None:  # EAGLE-3: attention over [embedding, feature]
            self.self_attn.qkv_proj = QKVParallelLinear(
                attn_in, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.qkv_bias, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype, SINGLE)

    def forward(self, positions, x, residual, cache, meta, backend):
        if residual is None:
            residual = x
            h = self.input_layernorm(x) if hasattr(self, "input_layernorm") else x
        else:
            residual = x + residual
            h = self.input_layernorm(residual)
        residual = self.self_attn(positions, h, cache, meta, backend) + residual
        return self.mlp(self.post_attention_layernorm(residual)), residual


class EagleHead(DraftHead):
    def __init__(self, raw: dict[str, Any], dtype: torch.dtype, embed: torch.Tensor,
                 lm_head: torch.Tensor, max_positions: int, fc_bias: bool = False) -> None:
        super().__init__()
        cfg = head_model_config(raw)
        self.cfg = cfg
        self.num_layers = cfg.num_layers
        self.embed, self.lm_head = embed, lm_head  # the target's: not parameters here
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=fc_bias, dtype=dtype)
        rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions)
        self.layers = nn.ModuleList(_Layer(cfg, dtype, rotary, input_norm=i > 0)
                                    for i in range(cfg.num_layers))

    def kv_layout(self, block_size: int, fmt: KVCacheFormat) -> KVLayout:
        return KVLayout.gqa(self.num_layers, self.cfg.num_kv_heads, self.cfg.head_dim,
                            block_size, fmt)

    def forward(self, input_ids, positions, feats, caches, meta, backend):
        x = self.fc(torch.cat([F.embedding(input_ids, self.embed), feats], dim=-1))
        residual = None
        for layer, cache in zip(self.layers, caches, strict=True):
            x, residual = layer(positions, x, residual, cache, meta, backend)
        out = x + residual
        return out, out

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return F.linear(out, self.lm_head).float()

    @classmethod
    def build(cls, raw: dict[str, Any], weights: dict[str, torch.Tensor], dtype: torch.dtype,
              embed: torch.Tensor, lm_head: torch.Tensor, max_positions: int) -> EagleHead:
        weights = {k.removeprefix("model."): v for k, v in weights.items()
                   if not k.removeprefix("model.").startswith(("embed_tokens.", "lm_head."))}
        head = cls(raw, dtype, embed.to(dtype), lm_head.to(dtype), max_positions,
                   fc_bias="fc.bias" in weights)
        load_into(head, weights.items())
        return head


class Eagle3Head(DraftHead):
    def __init__(self, raw: dict[str, Any], dtype: torch.dtype, embed: torch.Tensor,
                 target_layers: int, max_positions: int) -> None:
        super().__init__()
        cfg = head_model_config(raw)
        if cfg.num_layers != 1:
            raise ValueError(f"EAGLE-3 heads with {cfg.num_layers} layers are not supported "
                             "(one midlayer)")
        h, vocab = cfg.hidden_size, cfg.vocab_size
        self.cfg = cfg
        self.vocab_size = vocab
        self.draft_vocab = int(raw.get("draft_vocab_size") or vocab)
        target_h = int(raw.get("target_hidden_size") or h)
        ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        layers = tuple(int(i) for i in ids) if ids else default_aux_layers(target_layers)
        if len(layers) != 3 or not all(0 <= i < target_layers for i in layers):
            raise ValueError(f"EAGLE-3 needs three target layers in [0, {target_layers}), "
                             f"got {layers}")
        self.feature_spec = FeatureSpec(aux_layers=layers)
        self.norm_before_residual = bool(raw.get("norm_before_residual", False))
        self.embed = embed  # replaced by the checkpoint's own `embed_tokens`, if any
        self.fc = nn.Linear(3 * target_h, h, bias=False, dtype=dtype)
        rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions)
        self.midlayer = _Layer(cfg, dtype, rotary, input_norm=True, attn_in=2 * h)
        self.midlayer.hidden_norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.lm_head = nn.Parameter(torch.empty(self.draft_vocab, h, dtype=dtype),
                                    requires_grad=False)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab, dtype=torch.int64))

    def kv_layout(self, block_size: int, fmt: KVCacheFormat) -> KVLayout:
        return KVLayout.gqa(1, self.cfg.num_kv_heads, self.cfg.head_dim, block_size, fmt)

    def target_features(self, features: StepFeatures) -> torch.Tensor:
        return self.fc(features.aux)

    def forward(self, input_ids, positions, feats, caches, meta, backend):
        layer = self.midlayer
        embeds = layer.input_layernorm(F.embedding(input_ids, self.embed))
        normed = layer.hidden_norm(feats)
        residual = normed if self.norm_before_residual else feats
        x = torch.cat([embeds, normed], dim=-1)
        residual = layer.self_attn(positions, x, caches[0], meta, backend) + residual
        pre = layer.mlp(layer.post_attention_layernorm(residual)) + residual
        return self.norm(pre), pre

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        small = F.linear(out, self.lm_head).float()
        if self.draft_vocab == self.vocab_size and not self.d2t.any():
            return small
        full = small.new_full((out.shape[0], self.vocab_size), float("-inf"))
        targets = torch.arange(self.draft_vocab, device=out.device) + self.d2t
        full[:, targets] = small
        return full

    @classmethod
    def build(cls, raw: dict[str, Any], weights: dict[str, torch.Tensor], dtype: torch.dtype,
              embed: torch.Tensor, target_layers: int, max_positions: int) -> Eagle3Head:
        named = {}
        for name, tensor in weights.items():
            name = name.removeprefix("model.")
            if name.startswith("layers.0."):
                name = "midlayer." + name.removeprefix("layers.0.")
            named[name] = tensor
        if "lm_head.weight" in named:
            named["lm_head"] = named.pop("lm_head.weight")
        own_embed = named.pop("embed_tokens.weight", None)
        d2t = named.pop("d2t", None)
        named.pop("t2d", None)
        head = cls(raw, dtype, (own_embed if own_embed is not None else embed).to(dtype),
                   target_layers, max_positions)
        if d2t is not None:
            if tuple(d2t.shape) != (head.draft_vocab,):
                raise ValueError(f"d2t has shape {list(d2t.shape)}; draft_vocab_size is "
                                 f"{head.draft_vocab}")
            head.d2t.copy_(d2t.to(torch.int64))
        elif head.draft_vocab != head.vocab_size:
            raise ValueError("an EAGLE-3 head with a reduced draft vocabulary needs d2t")
        load_into(head, named.items())
        return head


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's default EAGLE-3 taps (2, L / 2, L - 3), clamped into a shallow model."""
    last = num_layers - 1
    return min(2, last), min(num_layers // 2, last), max(min(num_layers - 3, last), 0)
