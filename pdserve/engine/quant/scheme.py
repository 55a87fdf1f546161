"""A weight-quantisation scheme: what the linear layers become and how checkpoint tensors reach
them. One small handler class per scheme (`Fp8Scheme`, `Int4Scheme`), chosen by configuration
(`resolve_quantization` in `checkpoint`), never by file name.

    scheme.covers(name)             whether the layer of that module name is quantised at all
    scheme.linear_method()          a fresh `LinearMethod` for one linear layer
    scheme.experts_method()         the same for one MoE experts layer (`FusedExperts`)
    scheme.default_lm_head          the LM head's precision under lm_head_dtype="auto"
    scheme.adapt(weights, shapes)   checkpoint tensors -> what the layers' loaders take
    scheme.key                      the block-hash key of the weights' numerics
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import torch

from pdserve.engine.layers.linear import LinearBase, LinearMethod
from pdserve.engine.layers.moe import ExpertsMethod, FusedExperts

Weights = Iterable[tuple[str, object]]
ShapesFn = Callable[[], Mapping[str, Sequence[int]]]
"""Lazily: every checkpoint tensor's name and shape (read from the file headers only)."""


class QuantScheme(ABC):
    family: str = ""
    """What `EngineConfig.quantization` calls it: "fp8" or "int4"."""
    default_lm_head: str = "model"
    """The LM head's precision when `lm_head_dtype` is "auto" (see `lm_head`)."""

    @property
    @abstractmethod
    def key(self) -> str:
        """Names the weights' numerics in the block hash (KV computed under another scheme is
        never reused)."""

    def covers(self, module_name: str) -> bool:
        """Whether the layer `module_name` (e.g. "layers.0.mlp.down_proj") takes this scheme;
        one that does not keeps the model's precision (mixed-precision recipes)."""
        return True

    @abstractmethod
    def linear_method(self) -> LinearMethod:
        """A new method for one linear layer (methods keep per-layer state)."""

    def experts_method(self) -> ExpertsMethod:
        """A new method for one MoE experts layer; schemes that do not cover experts refuse."""
        raise ValueError(f"quantization {self.family!r} does not support MoE expert layers")

    def adapt(self, weights: Weights, shapes: ShapesFn) -> Iterator[tuple[str, object]]:
        """Checkpoint tensors as the layers' weight loaders take them."""
        return iter(weights)


def install_quantization(model: torch.nn.Module, scheme: QuantScheme) -> int:
    """Give every linear layer and every MoE experts layer the scheme covers the scheme's
    method, before loading; returns the count. A layer that is not `quantizable` keeps its
    dense weight."""
    count = 0
    for name, module in model.named_modules():
        if not scheme.covers(name):
            continue
        if isinstance(module, LinearBase) and module.quantizable:
            method = scheme.linear_method()
        elif isinstance(module, FusedExperts):
            method = scheme.experts_method()
        else:
            continue
        module.method = method
        method.prepare(module)
        count += 1
    return count
