"""Qwen3 (dense): Llama attention with an RMSNorm over each head's q and k before rotary.

No qkv bias (unless `attention_bias`), an explicit `head_dim` that need not be
hidden / heads; everything else is the Llama decoder. The same attention serves Qwen3-MoE.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.engine.layers.norm import RMSNorm
from pdserve.engine.layers.rotary import RotaryEmbedding
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.models.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM
from pdserve.engine.parallel import ParallelContext


class QKNormAttention(Attention):
    """Attention whose q and k heads are RMS-normalised (one weight over head_dim, shared by
    all heads, so every TP rank holds all of it)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, tp: ParallelContext,
                 rotary: RotaryEmbedding) -> None:
        super().__init__(cfg, dtype, tp, rotary)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().project(x)
        return self.q_norm(q), self.k_norm(k), v


def make_attention(cfg: ModelConfig, dtype: torch.dtype, tp: ParallelContext,
                   rotary: RotaryEmbedding) -> Attention:
    """The attention a Llama-shaped family uses (with q/k norms when the config says so)."""
    cls = QKNormAttention if cfg.qk_norm else Attention
    return cls(cfg, dtype, tp, rotary)


class Qwen3ForCausalLM(LlamaForCausalLM):
    def make_layer(self, index: int, cfg: ModelConfig, dtype: torch.dtype, tp: ParallelContext,
                   rotary: RotaryEmbedding) -> nn.Module:
        return DecoderLayer(cfg, dtype, make_attention(cfg, dtype, tp, rotary),
                            MLP(cfg, dtype, tp))
