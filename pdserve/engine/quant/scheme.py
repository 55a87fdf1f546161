"""A weight-quantisation scheme: what the linear layers become and how checkpoint tensors reach
them. One small handler class per scheme (`Fp8Scheme`, `Int4Scheme`), chosen by configuration
(`resolve_quantization` in `checkpoint`), never by file name.

    scheme.linear_method()          a fresh `LinearMethod` for one linear layer
    scheme.lm_head_method(tied)     the LM head's method, or None (it stays in the model dtype)
    scheme.adapt(weights, shapes)   checkpoint tensors -> what the layers' loaders take
    scheme.key                      the block-hash key of the weights' numerics
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import torch

from pdserve.engine.layers.embedding import ParallelLMHead
from pdserve.engine.layers.linear import LinearBase, LinearMethod

Weights = Iterable[tuple[str, object]]
ShapesFn = Callable[[], Mapping[str, Sequence[int]]]
"""Lazily: every checkpoint tensor's name and shape (read from the file headers only)."""


class QuantScheme(ABC):
    family: str = ""
    """What `EngineConfig.quantization` calls it: "fp8" or "int4"."""

    @property
    @abstractmethod
    def key(self) -> str:
        """Names the weights' numerics in the block hash (KV computed under another scheme is
        never reused)."""

    @abstractmethod
    def linear_method(self) -> LinearMethod:
        """A new method for one linear layer (methods keep per-layer state)."""

    def lm_head_method(self, tied: bool) -> LinearMethod | None:
        """The LM head's method; None keeps it dense in the model's dtype."""
        return None

    def adapt(self, weights: Weights, shapes: ShapesFn) -> Iterator[tuple[str, object]]:
        """Checkpoint tensors as the layers' weight loaders take them."""
        return iter(weights)


def install_quantization(model: torch.nn.Module, scheme: QuantScheme, tied: bool) -> int:
    """Give every linear layer (and the LM head, if the scheme says so) its method, before
    loading; returns how many layers got one."""
    count = 0
    for module in model.modules():
        if isinstance(module, LinearBase):
            method = scheme.linear_method()
        elif isinstance(module, ParallelLMHead):
            method = scheme.lm_head_method(tied)
            if method is None:
                continue
        else:
            continue
        module.method = method
        method.prepare(module)
        count += 1
    return count
