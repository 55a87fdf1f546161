"""Learned draft heads: EAGLE, EAGLE-3, MTP (with their own KV; `FeatureProposer`) and
Medusa (no KV; `MedusaProposer`), built from `speculative_config` in vLLM's layouts.

    base.py     the head interface, checkpoint reading, the target's embedding / LM head
    eagle.py    EAGLE (fc + Llama layers) and EAGLE-3 (fused target layers, draft vocab)
    mtp.py      DeepSeek-V3's MTP layer (MLA + MoE decoder layer) from the target checkpoint
    medusa.py   Medusa heads and their proposer
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kv_store.block_pool import BlockPool
from pdserve.engine.quant.kv_format import KVCacheFormat
from pdserve.engine.spec.config import SpecConfig
from pdserve.engine.spec.proposer import Proposer

if TYPE_CHECKING:
    from pdserve.engine.engine import LLMEngine


def build_head_proposer(cfg: SpecConfig, engine: LLMEngine) -> Proposer:
    """The proposer of a learned head (`cfg.method` eagle, eagle3, mtp or medusa)."""
    from pdserve.engine.spec.feature_drafter import FeatureProposer
    from pdserve.engine.spec.heads.base import target_embedding_and_head
    from pdserve.engine.spec.heads.medusa import MedusaHeads, MedusaProposer

    embed, lm_head = target_embedding_and_head(engine)
    with torch.device(engine.device):
        if cfg.method == "medusa":
            heads = _medusa(cfg, engine, MedusaHeads)
            return MedusaProposer(heads.eval(), engine.runner.sampler, engine.eos_token_ids,
                                  cfg.draft_greedy, _cost(heads, engine, 0))
        head = _head(cfg, engine, embed, lm_head)
        layout = head.kv_layout(engine.config.block_size, KVCacheFormat(engine.dtype))
        blocks = cfg.draft_num_gpu_blocks or engine.pool.num_blocks + engine.config.max_num_seqs
        caches = layout.new_caches(blocks, 1, engine.device)
    shared_head = lm_head.numel() if cfg.method == "eagle" else 0
    return FeatureProposer(head.eval(), caches, BlockPool(blocks, engine.config.block_size,
                                                          enable_caching=False),
                           engine.config.block_size, engine.runner.backend,
                           engine.runner.sampler, engine.eos_token_ids, cfg.draft_greedy,
                           _cost(head, engine, shared_head))


def _head(cfg: SpecConfig, engine: LLMEngine, embed: torch.Tensor, lm_head: torch.Tensor):
    from pdserve.engine.spec.heads.base import iter_safetensors, read_config
    from pdserve.engine.spec.heads.eagle import Eagle3Head, EagleHead
    from pdserve.engine.spec.heads.mtp import MTPHead

    target = engine.model_config
    if cfg.method == "mtp":
        from pdserve.engine.checkpoint import open_checkpoint

        ckpt = open_checkpoint(cfg.model or engine.config.model)
        if ckpt.model_config.hidden_size != target.hidden_size:
            raise ValueError("speculative_config.model's MTP layers do not fit the target")
        return MTPHead.build(ckpt.model_config, ckpt.iter_weights(), engine.dtype, embed,
                             lm_head, engine.max_model_len)
    raw = read_config(cfg.model)
    _check_fit(raw, engine, "target_hidden_size" if cfg.method == "eagle3" else "hidden_size")
    weights = dict(iter_safetensors(cfg.model))
    if cfg.method == "eagle":
        return EagleHead.build(raw, weights, engine.dtype, embed, lm_head, engine.max_model_len)
    return Eagle3Head.build(raw, weights, engine.dtype, embed, target.num_layers,
                            engine.max_model_len)


def _medusa(cfg: SpecConfig, engine: LLMEngine, cls):
    from pdserve.engine.spec.heads.base import iter_safetensors, read_config

    raw = read_config(cfg.model)
    _check_fit(raw, engine, "hidden_size")
    if cfg.num_speculative_tokens > int(raw["num_heads"]):
        raise ValueError(f"speculative_config.num_speculative_tokens "
                         f"{cfg.num_speculative_tokens} exceeds the checkpoint's "
                         f"{raw['num_heads']} Medusa heads")
    return cls.build(raw, dict(iter_safetensors(cfg.model)), engine.dtype, engine.vocab_size)


def _check_fit(raw: dict, engine: LLMEngine, hidden_key: str) -> None:
    """A head reads the target's features and writes its vocabulary: both must match."""
    target = engine.model_config
    hidden = int(raw.get(hidden_key) or raw.get("hidden_size") or 0)
    if hidden != target.hidden_size:
        raise ValueError(f"speculative_config.model reads {hidden}-wide features; the "
                         f"target's hidden size is {target.hidden_size}")
    if int(raw.get("vocab_size") or engine.vocab_size) != engine.vocab_size:
        raise ValueError(f"speculative_config.model has vocab_size {raw.get('vocab_size')}; "
                         f"the target's is {engine.vocab_size}")


def _cost(head: torch.nn.Module, engine: LLMEngine, shared: int) -> float:
    """The head's share of a target forward, by parameters (plus a shared LM head it runs)."""
    own = sum(p.numel() for p in head.parameters()) + shared
    return own / max(1, sum(p.numel() for p in engine.runner.model.parameters()))


__all__ = ["build_head_proposer"]
