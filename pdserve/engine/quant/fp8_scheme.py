"""The FP8 (W8A8 E4M3) scheme: quantised at load, or read from an FP8 checkpoint.

A model runs FP8 when asked to (`EngineConfig.quantization == "fp8"`: full-precision weights
are quantised at load) or when its `config.json` says `quantization_config.quant_method ==
"fp8"` (the checkpoint stores E4M3 linear weights plus a `<layer>.weight_scale` each, which
are loaded as they are). Checkpoint scales are per tensor (a scalar) or per output channel
(`[N]` / `[N, 1]`); both are turned into a `[N, 1]` column before reaching the model, so each
TP layer's `weight_loader` shards them exactly like the weight's rows, and the scales of fused
layers (q/k/v, gate/up) land in the rows of their own shard.

Static activation / KV scales (`input_scale`, `k_scale`, `v_scale`) are dropped: this engine
always computes activation and KV scales dynamically, which is at least as accurate.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.layers.linear import LinearMethod
from pdserve.engine.layers.moe import ExpertsMethod
from pdserve.engine.quant.fp8 import Fp8LinearMethod
from pdserve.engine.quant.fp8_experts import Fp8ExpertsMethod
from pdserve.engine.quant.scheme import QuantScheme, ShapesFn, Weights

SCALE_SUFFIX = ".weight_scale"
_STATIC_SCALE_SUFFIXES = (".input_scale", ".k_scale", ".v_scale")
_FULL_PRECISION_OK = ("lm_head",)  # kept in full precision here anyway


@dataclass(frozen=True)
class Fp8Scheme(QuantScheme):
    serialized: bool = False
    """The checkpoint already holds FP8 weights and their scales."""

    family = "fp8"

    @property
    def key(self) -> str:
        return "fp8"

    @classmethod
    def from_config(cls, qc: Mapping) -> Fp8Scheme:
        """An FP8 checkpoint's scheme; refuses what the loader cannot keep exact."""
        if qc.get("weight_block_size"):
            raise ValueError("config.json quantization_config.weight_block_size: block-wise "
                             "FP8 checkpoints are not supported (per-tensor or per-channel only)")
        ignored = (list(qc.get("ignored_layers") or [])
                   + list(qc.get("modules_to_not_convert") or []))
        unsupported = [n for n in ignored if not any(k in n for k in _FULL_PRECISION_OK)]
        if unsupported:
            raise ValueError(f"config.json quantization_config ignores layers {unsupported[:3]}: "
                             "mixed-precision FP8 checkpoints are not supported")
        return cls(serialized=True)

    def linear_method(self) -> LinearMethod:
        return Fp8LinearMethod(serialized=self.serialized)

    def experts_method(self) -> ExpertsMethod:
        return Fp8ExpertsMethod(serialized=self.serialized)

    def adapt(self, weights: Weights, shapes: ShapesFn) -> Iterator[tuple[str, object]]:
        if not self.serialized:
            return iter(weights)
        return adapt_fp8_checkpoint(weights, shapes())


def adapt_fp8_checkpoint(weights: Iterable[tuple[str, torch.Tensor]],
                         weight_shapes: Mapping[str, Sequence[int]]
                         ) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors with every `weight_scale` as an [N, 1] float32 column.

    `weight_shapes` maps tensor names to shapes (read from the file headers): a per-tensor
    scale is expanded to the row count of its own weight.
    """
    for name, tensor in weights:
        if name.endswith(_STATIC_SCALE_SUFFIXES):
            continue
        if name.endswith(SCALE_SUFFIX):
            weight_name = name.removesuffix("_scale")
            if weight_name not in weight_shapes:
                raise ValueError(f"checkpoint has {name!r} but no {weight_name!r}")
            tensor = scale_column(tensor, weight_shapes[weight_name][0], name)
        yield name, tensor


def scale_column(scale: torch.Tensor, rows: int, name: str = "weight_scale") -> torch.Tensor:
    """A per-tensor or per-channel scale as a float32 [rows, 1] column."""
    scale = scale.float()
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(rows, 1).contiguous()
    if scale.numel() != rows or (scale.dim() == 2 and scale.shape[1] != 1) or scale.dim() > 2:
        raise ValueError(f"{name}: expected a scalar, [{rows}] or [{rows}, 1] scale, got "
                         f"{list(scale.shape)}")
    return scale.reshape(rows, 1)
