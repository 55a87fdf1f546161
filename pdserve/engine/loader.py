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


def load_model(model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype,
               device: torch.device, tp: ParallelContext = SINGLE,
               max_positions: int | None = None) -> torch.nn.Module:
    model_dir = Path(model_dir)
    with torch.device(device):
        model = MODEL_CLASSES[cfg.family](cfg, dtype, tp, max_positions)
    loaded = model.load_weights(iter_weights(model_dir))
    expected = {n for n, _ in model.named_parameters()}
    missing = expected - loaded
    if missing:
        raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:5]}")
    for module in model.modules():
        method = getattr(module, "method", None)
        if method is not None:
            method.finalize(module)
    return model.eval()
