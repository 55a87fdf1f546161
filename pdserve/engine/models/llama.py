"""Llama-family decoder (Llama 2/3, Mistral, Qwen2): one module, the differences are config.

Layers are plain `nn.Module`s over a flat token batch ([T, hidden]); attention reads and writes
the paged KV cache through the backend. `load_weights` maps Hugging Face parameter names onto
the fused QKV / gate-up projections and lets each TP layer take its own shard.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.attention.backend import AttentionBackend
from pdserve.engine.attention.metadata import AttentionMetadata
from pdserve.engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pdserve.engine.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pdserve.engine.layers.norm import RMSNorm
from pdserve.engine.layers.rotary import RotaryEmbedding
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.parallel import SINGLE, ParallelContext

# Called after each layer has written its KV: the prefill worker streams that layer out.
LayerHook = Callable[[int], None]

_STACKED = (  # (our parameter, checkpoint name, shard id)
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, tp: ParallelContext,
                 rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads,
                                          cfg.num_kv_heads, cfg.qkv_bias, dtype, tp)
        self.o_proj = RowParallelLinear(cfg.q_size, cfg.hidden_size, cfg.o_bias, dtype, tp)
        self.rotary = rotary
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.window = cfg.sliding_window

    def forward(self, positions: torch.Tensor, x: torch.Tensor, cache: torch.Tensor,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        backend.write_kv(cache, k, v, meta)
        out = backend.attend(q, cache, meta, self.scale, self.window)
        return self.o_proj(out.reshape(t, q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, tp: ParallelContext) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size] * 2, cfg.mlp_bias, dtype, tp)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size,
                                           cfg.mlp_bias, dtype, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, tp: ParallelContext,
                 rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype, tp, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype, tp)

    def forward(self, positions, x, cache, meta, backend):
        x = x + self.self_attn(positions, self.input_layernorm(x), cache, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                 tp: ParallelContext = SINGLE, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        rotary = RotaryEmbedding(cfg.rope, cfg.head_dim,
                                 max_positions or cfg.max_position_embeddings)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, tp, rotary)
                                    for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dtype, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                caches: list[torch.Tensor], meta: AttentionMetadata,
                backend: AttentionBackend, layer_hook: LayerHook | None = None
                ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm."""
        x = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            x = layer(positions, x, caches[i], meta, backend)
            if layer_hook is not None:
                layer_hook(i)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors into this rank's parameters; returns the names loaded."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            target, shard = name, None
            for fused, part, shard_id in _STACKED:
                if f".{part}." in name:
                    target, shard = name.replace(part, fused), shard_id
                    break
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            owner = self.get_submodule(target.rsplit(".", 1)[0])
            loader = getattr(owner, "weight_loader", None)
            if loader is None:
                param.data.copy_(tensor)
            else:  # a 4-bit `Int4Weight` goes to the layer as it is
                loader(param, tensor.to(param.dtype) if torch.is_tensor(tensor) else tensor, shard)
            loaded.add(target)
        return loaded
