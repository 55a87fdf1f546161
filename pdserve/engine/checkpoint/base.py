"""What every checkpoint format gives the engine, the router and the workers.

A `Checkpoint` is opened once per process from a path (`open_checkpoint`) and answers, lazily:

    model_config     the architecture (`ModelConfig`)
    tokenizer()      a `pdserve.tokenizer.Tokenizer` (built on demand; the router's and LLM's)
    eos_token_ids    the ids that end generation
    model_id         the default served name (and block-hash key) when none is configured
    iter_weights()   `(hf_parameter_name, tensor)` pairs in Hugging Face naming and layout
    weight_shapes()  every weight's shape, from the file headers only

Formats differ only behind this interface; the model classes see Hugging Face names and
`nn.Linear`-layout tensors whatever the file was. With `prefer_int4=True` a format that stores
4-bit linear weights natively yields them as `Int4Weight` (pdserve/engine/quant/int4_weight.py)
instead of dense tensors; everything else stays dense.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.engine.model_config import ModelConfig

if TYPE_CHECKING:
    import torch

    from pdserve.engine.quant.int4_weight import Int4Weight
    from pdserve.tokenizer import Tokenizer


class Checkpoint(ABC):
    format: str = ""
    """"hf" or "gguf"."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @cached_property
    def model_config(self) -> ModelConfig:
        return self._read_model_config()

    @property
    def model_id(self) -> str:
        """The default served model name: the checkpoint directory's name, or a file's stem."""
        return self.path.stem if self.path.is_file() else self.path.name

    @property
    @abstractmethod
    def eos_token_ids(self) -> frozenset[int]: ...

    @abstractmethod
    def tokenizer(self) -> Tokenizer: ...

    @abstractmethod
    def iter_weights(self, prefer_int4: bool = False
                     ) -> Iterator[tuple[str, torch.Tensor | Int4Weight]]: ...

    @abstractmethod
    def weight_shapes(self) -> dict[str, list[int]]: ...

    def native_quantization(self) -> str | None:
        """The weight scheme the file's own blocks are ("int4": every linear weight a 4-bit
        block format), run as stored unless `quantization="none"`; None: dense weights (or a
        scheme that config.json's quantization_config names)."""
        return None

    @abstractmethod
    def _read_model_config(self) -> ModelConfig: ...

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r})"
