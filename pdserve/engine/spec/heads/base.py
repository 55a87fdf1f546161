"""The interface of a learned draft head, and what every head loader shares.

A head drafts from the target's features (`pdserve.engine.spec.features`). Draft position i
pairs the token at position i + 1 with the feature of position i (the target's hidden state
that predicted that token) and predicts the token at i + 2; chained steps feed the head's
own output feature instead. Heads with attention (EAGLE, EAGLE-3, MTP) keep their own paged
KV over positions (`kv_layout`); Medusa has none (`medusa.py`, its own proposer).

Checkpoints are read in the layouts vLLM loads (names and shapes; see each head's module).
Embeddings and LM heads a head does not carry are the target's: shared tensors when the
target runs on one rank with a dense LM head, a full copy read from the target checkpoint
otherwise (rank 0 of a tensor-parallel target holds only a vocabulary slice; an int4 or bf16
`lm_head_dtype` releases an untied head's dense weight).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from torch import nn

from pdserve.engine.attention.backend import AttentionBackend
from pdserve.engine.attention.metadata import AttentionMetadata
from pdserve.engine.kv_layout import KVLayout
from pdserve.engine.quant.kv_format import KVCacheFormat
from pdserve.engine.spec.features import FeatureSpec, StepFeatures

if TYPE_CHECKING:
    from pdserve.engine.engine import LLMEngine

_STACKED = (  # (our fused parameter, checkpoint part, shard id)
    ("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))


class DraftHead(nn.Module, ABC):
    """A head with its own attention over draft positions (EAGLE, EAGLE-3, MTP)."""

    feature_spec: FeatureSpec = FeatureSpec()
    num_layers: int = 1

    @abstractmethod
    def kv_layout(self, block_size: int, fmt: KVCacheFormat) -> KVLayout:
        """The layout of the head's own paged KV (one cache per head layer)."""

    def target_features(self, features: StepFeatures) -> torch.Tensor:
        """[n, H] the head's input feature for target positions (default: final hidden)."""
        return features.hidden

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, feats: torch.Tensor,
                caches: list[torch.Tensor], meta: AttentionMetadata,
                backend: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """(what `logits` reads, the feature a chained step feeds back), each [T, H]."""

    @abstractmethod
    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """[n, V] logits over the target's vocabulary (-inf outside a reduced draft vocab)."""


def read_config(path: str | Path) -> dict[str, Any]:
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        raise ValueError(f"speculative_config.model has no config.json: {path}")
    return json.loads(cfg.read_text())


def iter_safetensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"speculative_config.model has no safetensors weights: {path}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                yield name, f.get_tensor(name)


def llama_target(name: str) -> tuple[str, object]:
    """q/k/v and gate/up into their fused layers (with the shard id their loaders take)."""
    for fused, part, shard_id in _STACKED:
        if f".{part}." in name:
            return name.replace(part, fused), shard_id
    return name, None


def load_into(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
              optional: tuple[str, ...] = (),
              target: Callable[[str], tuple[str, object]] = llama_target) -> None:
    """Copy named tensors into `module` (`target` maps a name to our parameter and the
    shard id its layer's `weight_loader` takes); every parameter must be set except those
    under `optional`. A tensor with no place is refused by name."""
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        target_name, shard = target(name)
        param = params.get(target_name)
        if param is None:
            raise ValueError(f"draft checkpoint tensor {name!r} has no place in the head")
        owner = (module.get_submodule(target_name.rsplit(".", 1)[0]) if "." in target_name
                 else module)
        loader = getattr(owner, "weight_loader", None)
        value = tensor.to(param.dtype)
        if loader is None:
            if tuple(param.shape) != tuple(value.shape):
                raise ValueError(f"draft tensor {name!r} has shape {list(value.shape)}, the "
                                 f"head expects {list(param.shape)}")
            param.data.copy_(value)
        else:
            loader(param, value, shard)
        loaded.add(target_name)
    missing = sorted(n for n in set(params) - loaded if not n.startswith(optional))
    if missing:
        raise ValueError(f"draft checkpoint is missing {missing[:5]}")


def target_embedding_and_head(engine: LLMEngine) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding and LM head, [V, H] each, whole (see the module doc)."""
    model = engine.runner.model
    v = engine.vocab_size
    embed, head = model.embed_tokens.weight, model.lm_head.weight
    if engine.tp.size == 1 and head.shape == embed.shape:
        return embed[:v], head[:v]
    # TP > 1, or an LM head whose dense weight was released for a 4-bit / bf16 copy.
    from pdserve.engine.checkpoint import open_checkpoint

    found: dict[str, torch.Tensor] = {}
    for name, tensor in open_checkpoint(engine.config.model).iter_weights():
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            found[name] = tensor.to(device=engine.device, dtype=engine.dtype)
    embed = found["model.embed_tokens.weight"]
    return embed, found.get("lm_head.weight", embed)
