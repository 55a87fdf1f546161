"""Hugging Face checkpoints: a directory with config.json, single or sharded safetensors (read
lazily, one tensor at a time) and tokenizer files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import safe_open

from pdserve.engine.checkpoint.base import Checkpoint
from pdserve.engine.model_config import ModelConfig
from pdserve.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch


class HFCheckpoint(Checkpoint):
    format = "hf"

    def _read_model_config(self) -> ModelConfig:
        return ModelConfig.from_pretrained(self.path)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """config.json's eos_token_id plus generation_config.json's (what HF generate stops on)."""
        ids = set(self.model_config.eos_token_ids)
        gen = self.path / "generation_config.json"
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else ([] if eos is None else [eos]))
        return frozenset(int(i) for i in ids)

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_pretrained(self.path)

    def files(self) -> list[Path]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return [self.path / f for f in sorted(set(weight_map.values()))]
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"no safetensors weights in {self.path}")
        return files

    def iter_weights(self, prefer_int4: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        # Safetensors hold dense (or FP8) tensors only: prefer_int4 has nothing to pick.
        for path in self.files():
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                    yield name, f.get_tensor(name)

    def weight_shapes(self) -> dict[str, list[int]]:
        shapes: dict[str, list[int]] = {}
        for path in self.files():
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                    shapes[name] = list(f.get_slice(name).get_shape())
        return shapes
