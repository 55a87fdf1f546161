"""Which quantisation a model runs, installing it, and adapting FP8 checkpoints to the loader.

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

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.engine.layers.linear import LinearBase
from pdserve.engine.layers.moe import FusedExperts
from pdserve.engine.quant.fp8 import Fp8LinearMethod
from pdserve.engine.quant.fp8_experts import Fp8ExpertsMethod

SCALE_SUFFIX = ".weight_scale"
_STATIC_SCALE_SUFFIXES = (".input_scale", ".k_scale", ".v_scale")
_FULL_PRECISION_OK = ("lm_head",)  # kept in full precision here anyway


@dataclass(frozen=True)
class QuantScheme:
    method: str
    """Only "fp8" (W8A8 E4M3) for now."""
    serialized: bool
    """The checkpoint already holds FP8 weights and their scales."""


def resolve_quantization(requested: str | None, model_dir: str | Path) -> QuantScheme | None:
    """The scheme to run: the checkpoint's own, else the requested one, else None."""
    if requested not in (None, "fp8"):
        raise ValueError(f"quantization must be None or 'fp8', got {requested!r}")
    qc = _checkpoint_quant_config(Path(model_dir))
    if qc is None:
        return None if requested is None else QuantScheme("fp8", serialized=False)
    method = qc.get("quant_method")
    if method != "fp8":
        raise ValueError(f"config.json quantization_config.quant_method {method!r} is not "
                         "supported (only 'fp8')")
    if qc.get("weight_block_size"):
        raise ValueError("config.json quantization_config.weight_block_size: block-wise FP8 "
                         "checkpoints are not supported (per-tensor or per-channel only)")
    ignored = list(qc.get("ignored_layers") or []) + list(qc.get("modules_to_not_convert") or [])
    unsupported = [n for n in ignored if not any(k in n for k in _FULL_PRECISION_OK)]
    if unsupported:
        raise ValueError(f"config.json quantization_config ignores layers {unsupported[:3]}: "
                         "mixed-precision FP8 checkpoints are not supported")
    return QuantScheme("fp8", serialized=True)


def _checkpoint_quant_config(model_dir: Path) -> dict | None:
    path = model_dir / "config.json"
    if not path.is_file():
        return None
    qc = json.loads(path.read_text()).get("quantization_config")
    if qc is not None and not isinstance(qc, dict):
        raise ValueError("config.json quantization_config must be an object")
    return qc


def install_quantization(model: torch.nn.Module, scheme: QuantScheme) -> int:
    """Give every linear layer and every MoE experts layer the scheme's method (before
    loading); returns the count."""
    count = 0
    for module in model.modules():
        if isinstance(module, LinearBase):
            method = Fp8LinearMethod(serialized=scheme.serialized)
        elif isinstance(module, FusedExperts):
            method = Fp8ExpertsMethod(serialized=scheme.serialized)
        else:
            continue
        module.method = method
        method.prepare(module)
        count += 1
    return count


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
