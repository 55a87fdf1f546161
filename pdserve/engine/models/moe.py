"""Mixture-of-experts decoders with GQA attention: Mixtral, Qwen2-MoE, Qwen3-MoE.

The Llama decoder with a `SparseMoeBlock` as the MLP of every layer `MoEConfig.sparse_layers`
names (the others keep a dense MLP: Qwen's `mlp_only_layers` / `decoder_sparse_step`) and,
for Qwen3-MoE, q/k-normed attention. Checkpoint names: Mixtral's `block_sparse_moe.` is our
`mlp.`, DeepSeek's `shared_experts.` our `shared_expert.`, and each expert's matrices land in
the stacked expert parameters.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pdserve.engine.layers.moe import IMPLS, FusedExperts
from pdserve.engine.layers.moe_block import SparseMoeBlock, expert_param_target
from pdserve.engine.layers.rotary import RotaryEmbedding
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.models.llama import MLP, DecoderLayer, LlamaForCausalLM
from pdserve.engine.models.qwen3 import make_attention
from pdserve.engine.parallel import SINGLE, ParallelContext

_RENAMES = ((".block_sparse_moe.", ".mlp."), (".shared_experts.", ".shared_expert."))


class MoEForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                 tp: ParallelContext = SINGLE, max_positions: int | None = None) -> None:
        if cfg.moe is None:
            raise ValueError(f"{cfg.family} config has no mixture-of-experts numbers")
        super().__init__(cfg, dtype, tp, max_positions)

    def make_layer(self, index: int, cfg: ModelConfig, dtype: torch.dtype, tp: ParallelContext,
                   rotary: RotaryEmbedding) -> nn.Module:
        mlp = (SparseMoeBlock(cfg.moe, cfg.hidden_size, dtype, tp) if cfg.moe.is_sparse(index)
               else MLP(cfg, dtype, tp))
        return DecoderLayer(cfg, dtype, make_attention(cfg, dtype, tp, rotary), mlp)

    def param_target(self, name: str) -> tuple[str, object]:
        for old, new in _RENAMES:
            name = name.replace(old, new)
        expert = expert_param_target(name)
        return expert if expert is not None else super().param_target(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = super().load_weights(weights)
        for name, module in self.named_modules():
            if isinstance(module, FusedExperts):
                module.check_loaded(name)
        return loaded


def set_experts_impl(model: nn.Module, impl: str) -> None:
    """Run every MoE block of `model` the `impl` way ("grouped" or "per_token")."""
    if impl not in IMPLS:
        raise ValueError(f"experts impl must be one of {IMPLS}, got {impl!r}")
    for module in model.modules():
        if isinstance(module, FusedExperts):
            module.impl = impl
