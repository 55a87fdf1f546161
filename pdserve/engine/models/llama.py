"""Llama-family decoder (Llama 2/3, Mistral, Qwen2): one module, the differences are config.

Layers are plain `nn.Module`s over a flat token batch ([T, hidden]); attention reads and writes
the paged KV cache through the backend. `load_weights` maps Hugging Face parameter names onto
the fused QKV / gate-up projections and lets each TP layer take its own shard.

Other families reuse it by overriding `make_layer` (their attention or MLP) and
`param_target` (their checkpoint names): `qwen3.py` (q/k norms), `moe.py` (expert MLPs).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from pdserve.engine.attention.backend import AttentionBackend
from pdserve.engine.attention.metadata import AttentionMetadata
from pdserve.engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pdserve.engine.layers.fused import silu_mul
from pdserve.engine.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pdserve.engine.layers.norm import RMSNorm
from pdserve.engine.layers.rotary import RopeAt, RotaryEmbedding
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.parallel import SINGLE, ParallelContext

# Called after each layer has written its KV: the prefill worker streams that layer out.
LayerHook = Callable[[int], None]
# Runs one layer: (layer, rope, x, cache, meta, backend) -> x.
RunLayer = Callable[..., torch.Tensor]

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

    def forward(self, rope: RopeAt, x: torch.Tensor, cache: torch.Tensor,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.project(x)
        q, k = self.rotary(rope, q, k)
        backend.write_kv(cache, k, v, meta)
        out = backend.attend(q, cache, meta, self.scale, self.window)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> q [T, H, D], k and v [T, KVH, D], before rotary."""
        t = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        return (q.view(t, self.num_heads, self.head_dim),
                k.view(t, self.num_kv_heads, self.head_dim),
                v.view(t, self.num_kv_heads, self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, tp: ParallelContext) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size] * 2, cfg.mlp_bias, dtype, tp)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size,
                                           cfg.mlp_bias, dtype, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm residual block around an attention module and an MLP (dense or MoE)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, self_attn: nn.Module,
                 mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = mlp

    def forward(self, rope, x, cache, meta, backend):
        x, h = self.post_attention_layernorm.add_forward(
            x, self.self_attn(rope, self.input_layernorm(x), cache, meta, backend))
        return x + self.mlp(h)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                 tp: ParallelContext = SINGLE, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        rotary = self.make_rotary(cfg, max_positions or cfg.max_position_embeddings)
        self.rotary = rotary  # one table for every layer, looked up once per step
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, tp)
        self.layers = nn.ModuleList(self.make_layer(i, cfg, dtype, tp, rotary)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dtype, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def make_rotary(self, cfg: ModelConfig, max_positions: int) -> RotaryEmbedding:
        """The rotary table every layer shares (over `head_dim`; MLA: its rope part)."""
        return RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions)

    def make_layer(self, index: int, cfg: ModelConfig, dtype: torch.dtype, tp: ParallelContext,
                   rotary: RotaryEmbedding) -> nn.Module:
        """Decoder layer `index`; other families override the attention or the MLP."""
        return DecoderLayer(cfg, dtype, Attention(cfg, dtype, tp, rotary), MLP(cfg, dtype, tp))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                caches: list[torch.Tensor], meta: AttentionMetadata,
                backend: AttentionBackend, layer_hook: LayerHook | None = None,
                run_layer: RunLayer | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm. `run_layer(layer, rope, x, cache,
        meta, backend)` replaces the plain call of each layer (a compiled decode step)."""
        return self.forward_features(input_ids, positions, caches, meta, backend,
                                     layer_hook, run_layer=run_layer)[0]

    def forward_features(self, input_ids: torch.Tensor, positions: torch.Tensor,
                         caches: list[torch.Tensor], meta: AttentionMetadata,
                         backend: AttentionBackend, layer_hook: LayerHook | None = None,
                         aux_layers: tuple[int, ...] = (), run_layer: RunLayer | None = None
                         ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`forward`, plus the residual stream entering each layer of `aux_layers` (what an
        EAGLE-3 drafter fuses), in that order."""
        x = self.embed_tokens(input_ids)
        rope = self.rotary.at(positions, x.dtype)
        taken: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if i in aux_layers:
                taken[i] = x
            if run_layer is None:
                x = layer(rope, x, caches[i], meta, backend)
            else:
                x = run_layer(layer, rope, x, caches[i], meta, backend)
            if layer_hook is not None:
                layer_hook(i)
        return self.norm(x), [taken[i] for i in aux_layers]

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
            target, shard = self.param_target(name)
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            owner = self.get_submodule(target.rsplit(".", 1)[0])
            loader = getattr(owner, "weight_loader", None)
            if loader is None:
                param.data.copy_(tensor)
            else:
                # A 4-bit `Int4Weight` goes to its layer's loader as the checkpoint gave it.
                value = tensor.to(param.dtype) if isinstance(tensor, torch.Tensor) else tensor
                loader(param, value, shard)
            loaded.add(target)
        return loaded

    def param_target(self, name: str) -> tuple[str, object]:
        """(our parameter, shard id for its weight_loader) of checkpoint tensor `name`
        (without the `model.` prefix): q/k/v into qkv_proj, gate/up into gate_up_proj."""
        for fused, part, shard_id in _STACKED:
            if f".{part}." in name:
                return name.replace(part, fused), shard_id
        return name, None
