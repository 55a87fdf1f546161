"""Reading Hugging Face checkpoints: single or sharded safetensors, lazily, one tensor at a time."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.engine.model_config import ModelConfig
from pdserve.engine.models import MODEL_CLASSES
from pdserve.engine.parallel import SINGLE, ParallelContext
from pdserve.engine.quant.checkpoint import resolve_quantization
from pdserve.engine.quant.lm_head import install_lm_head, resolve_lm_head
from pdserve.engine.quant.scheme import install_quantization


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no safetensors weights in {model_dir}")
    return files


def iter_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                yield name, f.get_tensor(name)


def weight_shapes(model_dir: Path) -> dict[str, list[int]]:
    """Every tensor's shape, from the file headers only (no tensor data is read)."""
    shapes: dict[str, list[int]] = {}
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                shapes[name] = list(f.get_slice(name).get_shape())
    return shapes


def load_model(model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype,
               device: torch.device, tp: ParallelContext = SINGLE,
               max_positions: int | None = None,
               quantization: str | None = None, lm_head_dtype: str = "auto") -> torch.nn.Module:
    """Build and load the model; `quantization` ("fp8", "int4") quantises its linear layers,
    and a quantised checkpoint (quantization_config in config.json) loads as it is stored;
    `lm_head_dtype` picks the LM head's precision (see `quant.lm_head`)."""
    model_dir = Path(model_dir)
    scheme = resolve_quantization(quantization, model_dir)
    with torch.device(device):
        model = MODEL_CLASSES[cfg.family](cfg, dtype, tp, max_positions)
        if scheme is not None:  # before loading: quantised layers load into their own layout
            install_quantization(model, scheme)
        install_lm_head(model, resolve_lm_head(lm_head_dtype, scheme), cfg.tie_word_embeddings)
    weights = iter_weights(model_dir)
    if scheme is not None:
        weights = scheme.adapt(weights, lambda: weight_shapes(model_dir))
    loaded = model.load_weights(weights)
    expected = {n for n, _ in model.named_parameters()}
    missing = expected - loaded
    if missing:
        raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:5]}")
    for name, module in model.named_modules():
        method = getattr(module, "method", None)
        if method is not None:
            try:
                method.finalize(module)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from e
    return model.eval()
