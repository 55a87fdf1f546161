"""Multi-head latent attention (DeepSeek-V2 / V2-Lite / V3), from Hugging Face checkpoints.

    x ─► q_proj | q_b_proj(norm(q_a_proj x)) ─► per head [q_nope (dn), q_rope (dr)]
    x ─► kv_a_proj_with_mqa ─► [c_KV (r) ─► kv_a_layernorm, k_rope (dr)]
    rotary on q_rope and k_rope ─► cache row [c_KV, k_rope] (one per token, every head's)
    attention over the latent cache (`pdserve.engine.attention.mla`) ─► o_proj

Under tensor parallelism the heads split (q_proj / q_b_proj / kv_b_proj column-parallel by
head, o_proj row-parallel); the latent projection is replicated, so every rank computes and
caches the same rows (`KVLayout` MLA: one head on every rank). Rotary pairs are interleaved
in DeepSeek's checkpoints (V3's `rope_interleave: false` uses NeoX halves); they are
de-interleaved before the NeoX rotation, which changes no dot product. Yarn scaling follows
transformers: cos/sin carry yarn's attention factor, the softmax scale mscale(all_dim)^2.
The small norms use eps 1e-6, as the reference implementations do.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.engine.attention.backend import AttentionBackend
from pdserve.engine.attention.metadata import AttentionMetadata
from pdserve.engine.attention.mla import MLAHeads, mla_attend, write_latent
from pdserve.engine.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from pdserve.engine.layers.norm import RMSNorm
from pdserve.engine.layers.rotary import RopeAt, RotaryEmbedding, yarn_softmax_mscale
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.parallel import ParallelContext

LORA_NORM_EPS = 1e-6


class _DenseColumnParallelLinear(ColumnParallelLinear):
    """kv_b_proj: its weight is also read directly (absorbed attention), so it stays dense
    under quantisation."""

    quantizable = False


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, tp: ParallelContext,
                 rotary: RotaryEmbedding) -> None:
        super().__init__()
        m = cfg.mla
        if m is None:
            raise ValueError(f"{cfg.family} config has no MLA numbers")
        if cfg.num_heads % tp.size:
            raise ValueError(f"{cfg.num_heads} attention heads do not split over TP={tp.size}")
        h, hidden, bias = cfg.num_heads, cfg.hidden_size, cfg.o_bias
        self.mla = m
        self.num_heads = h // tp.size
        if m.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, h * m.qk_head_dim, False, dtype, tp)
        else:
            self.q_a_proj = ReplicatedLinear(hidden, m.q_lora_rank, bias, dtype, tp)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LORA_NORM_EPS, dtype)
            self.q_b_proj = ColumnParallelLinear(m.q_lora_rank, h * m.qk_head_dim, False,
                                                 dtype, tp)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, m.kv_lora_rank + m.qk_rope_head_dim,
                                                   bias, dtype, tp)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LORA_NORM_EPS, dtype)
        self.kv_b_proj = _DenseColumnParallelLinear(
            m.kv_lora_rank, h * (m.qk_nope_head_dim + m.v_head_dim), False, dtype, tp)
        self.o_proj = RowParallelLinear(h * m.v_head_dim, hidden, bias, dtype, tp)
        self.rotary = rotary
        self.scale = m.qk_head_dim ** -0.5 * yarn_softmax_mscale(cfg.rope)

    def forward(self, rope: RopeAt, x: torch.Tensor, cache: torch.Tensor,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        """`backend` is the GQA backend the decoder passes every layer (the CPU kernel's
        too); MLA does not use it: the latent cache has its own torch path."""
        m, t = self.mla, x.shape[0]
        q = self.q_proj(x) if m.q_lora_rank is None else self.q_b_proj(
            self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(t, self.num_heads, m.qk_head_dim).split(
            [m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split(
            [m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        q_rope, k_rope = self._rotate(rope, q_rope, k_rope.unsqueeze(1))
        write_latent(cache, self.kv_a_layernorm(latent), k_rope[:, 0], meta)
        heads = MLAHeads(self.kv_b_proj.weight, self.num_heads, m.qk_nope_head_dim,
                         m.v_head_dim)
        out = mla_attend(q_nope, q_rope, cache, meta, heads, self.scale)
        return self.o_proj(out.reshape(t, self.num_heads * m.v_head_dim))

    def _rotate(self, rope: RopeAt, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.mla.rope_interleave:
            q, k = _deinterleave(q), _deinterleave(k)
        return self.rotary(rope, q, k)


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...): pairs become NeoX halves."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
