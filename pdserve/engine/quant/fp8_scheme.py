"""The FP8 (W8A8 E4M3) scheme: quantised at load, or read from an FP8 checkpoint.

A model runs FP8 when asked to (`EngineConfig.quantization == "fp8"`: full-precision weights
are quantised at load) or when its `config.json` says `quantization_config.quant_method ==
"fp8"` (the checkpoint stores E4M3 linear weights plus a `<layer>.weight_scale` each, which
are loaded as they are). Checkpoint scales are per tensor (a scalar) or per output channel
(`[N]` / `[N, 1]`); both are turned into a `[N, 1]` column before reaching the model, so each
TP layer's `weight_loader` shards them exactly like the weight's rows, and the scales of fused
layers (q/k/v, gate/up) land in the rows of their own shard.

Quantised at load, `full_precision` names the linear layers that stay in the model's precision
(fnmatch patterns over module names such as "layers.0.mlp.down_proj"), the mixed-precision
recipes vLLM / llm-compressor ship as `ignore` lists. `DEFAULT_FULL_PRECISION` was chosen from
bench/fp8_agreement.py on the real default model (docs/perf.md): plain E4M3 keeps 3 mantissa
bits whatever the scale's granularity, so finer scales buy little, and keeping the layers whose
error costs the most top-1 agreement is what moves it.

Static activation / KV scales (`input_scale`, `k_scale`, `v_scale`) are dropped: this engine
always computes activation and KV scales dynamically, which is at least as accurate.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase

import torch

from pdserve.engine.layers.linear import LinearMethod
from pdserve.engine.layers.moe import ExpertsMethod
from pdserve.engine.quant.fp8 import Fp8LinearMethod
from pdserve.engine.quant.fp8_experts import Fp8ExpertsMethod
from pdserve.engine.quant.scheme import QuantScheme, ShapesFn, Weights

SCALE_SUFFIX = ".weight_scale"
_STATIC_SCALE_SUFFIXES = (".input_scale", ".k_scale", ".v_scale")
_FULL_PRECISION_OK = ("lm_head",)  # kept in full precision here anyway
DEFAULT_FULL_PRECISION: tuple[str, ...] = ("layers.0.*", "*.mlp.down_proj")
"""Kept in the model's precision under quantization="fp8" unless told otherwise."""


@dataclass(frozen=True)
class Fp8Scheme(QuantScheme):
    serialized: bool = False
    """The checkpoint already holds FP8 weights and their scales."""
    full_precision: tuple[str, ...] | None = None
    """fnmatch patterns of module names kept in the model's precision; None: the default
    (`DEFAULT_FULL_PRECISION` at load, none for a serialized checkpoint, which is loaded as it
    is stored)."""

    family = "fp8"

    def __post_init__(self) -> None:
        patterns = self.full_precision
        if patterns is None:
            patterns = () if self.serialized else DEFAULT_FULL_PRECISION
        if isinstance(patterns, str) or not all(isinstance(p, str) and p for p in patterns):
            raise ValueError(f"fp8 full_precision must be a sequence of non-empty layer-name "
                             f"patterns, got {patterns!r}")
        object.__setattr__(self, "full_precision", tuple(patterns))  # hashable, comparable
        if self.serialized and self.full_precision:
            raise ValueError("an FP8 checkpoint is loaded as it is stored: full_precision "
                             "layers apply only to quantising at load")

    @property
    def key(self) -> str:
        if not self.full_precision:
            return "fp8"
        return "fp8-fullprec:" + ",".join(self.full_precision)

    def covers(self, module_name: str) -> bool:
        return not any(fnmatchcase(module_name, p) for p in self.full_precision)

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
