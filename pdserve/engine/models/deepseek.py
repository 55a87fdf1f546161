"""DeepSeek-V2 / V2-Lite / V3: multi-head latent attention plus the DeepSeek MoE block.

The Llama decoder with `MLAttention` in every layer and, as the MLP, a `SparseMoeBlock`
(routed experts, shared experts; V2's greedy / group-limited softmax routing, V3's noaux_tc
over sigmoid scores with the correction bias) in the layers `MoEConfig.sparse_layers`
names — the first `first_k_dense_replace` layers keep a dense MLP. Checkpoint names map as
they are, except the experts (stacked), `shared_experts.` (our `shared_expert.`) and gate/up
pairs (fused). V3 checkpoints may carry multi-token-prediction layers after the decoder
(`model.layers.<num_hidden_layers + i>`): they belong to the MTP drafter
(`pdserve.engine.spec.heads.mtp`), not to this model, and are skipped here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from pdserve.engine.layers.mla import MLAttention
from pdserve.engine.layers.moe_block import SparseMoeBlock, expert_param_target
from pdserve.engine.layers.rotary import RotaryEmbedding
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.models.llama import MLP, DecoderLayer
from pdserve.engine.models.moe import MoEForCausalLM
from pdserve.engine.parallel import ParallelContext

_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.")
_FUSED = (("gate_proj", "gate_up_proj", 0), ("up_proj", "gate_up_proj", 1))


class DeepseekForCausalLM(MoEForCausalLM):
    def make_rotary(self, cfg: ModelConfig, max_positions: int) -> RotaryEmbedding:
        return RotaryEmbedding(cfg.rope, cfg.mla.qk_rope_head_dim, max_positions)

    def make_layer(self, index: int, cfg: ModelConfig, dtype: torch.dtype, tp: ParallelContext,
                   rotary: RotaryEmbedding) -> nn.Module:
        mlp = (SparseMoeBlock(cfg.moe, cfg.hidden_size, dtype, tp) if cfg.moe.is_sparse(index)
               else MLP(cfg, dtype, tp))
        return DecoderLayer(cfg, dtype, MLAttention(cfg, dtype, tp, rotary), mlp)

    def param_target(self, name: str) -> tuple[str, object]:
        return deepseek_param_target(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights((n, t) for n, t in weights if not self.is_mtp_tensor(n))

    def is_mtp_tensor(self, name: str) -> bool:
        """A tensor of a multi-token-prediction layer (after the decoder's layers)."""
        m = _LAYER.match(name)
        return m is not None and int(m.group(1)) >= self.config.num_layers


def deepseek_param_target(name: str) -> tuple[str, object]:
    """(our parameter, shard id) of a DeepSeek decoder-layer tensor: experts stacked,
    `shared_experts.` as `shared_expert.`, gate/up fused; q/k/v keep their names (MLA has
    no fused QKV). Also what the MTP drafter's decoder layer loads with."""
    name = name.replace(".shared_experts.", ".shared_expert.")
    expert = expert_param_target(name)
    if expert is not None:
        return expert
    for part, fused, shard in _FUSED:
        if f".{part}." in name:
            return name.replace(part, fused), shard
    return name, None
