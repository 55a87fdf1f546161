"""DeepSeek-V3 multi-token prediction (`"method": "mtp"`): the MTP layers a target checkpoint
carries after its decoder (`num_nextn_predict_layers`), as vLLM loads them.

Layer L = num_hidden_layers (the first MTP layer; with several, chained steps reuse it):

    model.layers.L.{enorm, hnorm}.weight, eh_proj.weight [H, 2H],
    model.layers.L.shared_head.{norm.weight, head.weight}, optionally embed_tokens.weight,
    model.layers.L.{self_attn, mlp, input_layernorm, post_attention_layernorm}.*  (a full
    DeepSeek decoder layer: MLA, and an MoE block when the checkpoint gives it experts)

    e = enorm(embed(x_{i+1})) (zero at position 0), h = hnorm(f_i)
    out = decoder_layer(eh_proj([e, h]))  ─► logits = head(norm(out)); chained steps feed out

f_i is the target's final hidden state. The layer's own KV is an MLA latent cache.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.kv_layout import KVLayout
from pdserve.engine.layers.mla import MLAttention
from pdserve.engine.layers.moe import FusedExperts
from pdserve.engine.layers.moe_block import SparseMoeBlock
from pdserve.engine.layers.norm import RMSNorm
from pdserve.engine.layers.rotary import RotaryEmbedding
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.models.deepseek import deepseek_param_target
from pdserve.engine.models.llama import MLP, DecoderLayer
from pdserve.engine.parallel import SINGLE
from pdserve.engine.quant.kv_format import KVCacheFormat
from pdserve.engine.spec.heads.base import DraftHead, load_into

_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")


class MTPHead(DraftHead):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, sparse: bool, embed: torch.Tensor,
                 max_positions: int) -> None:
        super().__init__()
        if cfg.mla is None or cfg.num_mtp_layers < 1:
            raise ValueError("speculative_config method 'mtp' needs a target with MTP layers "
                             "(DeepSeek-V3's num_nextn_predict_layers)")
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.cfg = cfg
        self.embed = embed  # the target's unless the layer carries its own
        self.enorm, self.hnorm = RMSNorm(h, eps, dtype), RMSNorm(h, eps, dtype)
        self.eh_proj = nn.Linear(2 * h, h, bias=False, dtype=dtype)
        rotary = RotaryEmbedding(cfg.rope, cfg.mla.qk_rope_head_dim, max_positions)
        mlp = SparseMoeBlock(cfg.moe, h, dtype, SINGLE) if sparse else MLP(cfg, dtype, SINGLE)
        self.block = DecoderLayer(cfg, dtype, MLAttention(cfg, dtype, SINGLE, rotary), mlp)
        self.shared_head_norm = RMSNorm(h, eps, dtype)
        self.shared_head = nn.Parameter(torch.empty(cfg.vocab_size, h, dtype=dtype),
                                        requires_grad=False)

    def kv_layout(self, block_size: int, fmt: KVCacheFormat) -> KVLayout:
        m = self.cfg.mla
        return KVLayout.mla(1, m.kv_lora_rank, m.qk_rope_head_dim, block_size, fmt)

    def forward(self, input_ids, positions, feats, caches, meta, backend):
        e = F.embedding(input_ids, self.embed).masked_fill((positions == 0).unsqueeze(-1), 0)
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(feats)], dim=-1))
        out = self.block(positions, x, caches[0], meta, backend)
        return out, out

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return F.linear(self.shared_head_norm(out), self.shared_head).float()

    @classmethod
    def build(cls, cfg: ModelConfig, weights: Iterable[tuple[str, torch.Tensor]],
              dtype: torch.dtype, embed: torch.Tensor, lm_head: torch.Tensor,
              max_positions: int) -> MTPHead:
        """From the target checkpoint's tensors (only layer num_layers's are used)."""
        prefix = re.compile(rf"^(?:model\.)?layers\.{cfg.num_layers}\.")
        own = {prefix.sub("", n): t for n, t in weights if prefix.match(n)}
        if not own:
            raise ValueError(f"the target checkpoint has no MTP layer {cfg.num_layers} "
                             "(method 'mtp')")
        layer_embed = own.pop("embed_tokens.weight", None)
        head = cls(cfg, dtype, "mlp.gate.weight" in own,
                   (layer_embed if layer_embed is not None else embed).to(dtype), max_positions)
        named = {}
        for name, tensor in own.items():
            if name == "shared_head.norm.weight":
                name = "shared_head_norm.weight"
            elif name == "shared_head.head.weight":
                name = "shared_head"
            elif not name.startswith(_OWN):
                name = "block." + name
            named[name] = tensor
        if "shared_head" not in named:  # a layer without its own head reads the target's
            named["shared_head"] = lm_head
        load_into(head, named.items(), target=deepseek_param_target)
        for name, module in head.named_modules():
            if isinstance(module, FusedExperts):
                module.check_loaded(name)
        for module in head.modules():
            method = getattr(module, "method", None)
            if method is not None:
                method.finalize(module)
        return head
