"""GGUF checkpoints: one `.gguf` file, its header parsed once into a memory map (gguf_reader.py).

Everything is checked up front, before a model is built:
the architecture and hyper-parameters (gguf_config.py), every tensor's name and type
(gguf_weights.py), so an unsupported file fails at start with an error naming what it lacks.
Tensor data stays in the memory map until `iter_weights` converts one tensor at a time.

The tokenizer is built from the metadata on demand (gguf_tokenizer.py; ~0.1 s for a 49k
vocabulary), unless Hugging Face tokenizer files sit beside the file (`tokenizer_dir`): those are
the model's own and win. The prepared default model (pdserve/default_model.py) uses this: its
GGUF keeps the weights and hyper-parameters but not the vocabulary arrays.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.engine.checkpoint.base import Checkpoint
from pdserve.engine.checkpoint.gguf_config import model_config_from_gguf
from pdserve.engine.checkpoint.gguf_names import (
    CONFIG_TENSORS,
    PERMUTED_ARCHITECTURES,
    SUPPORTED_TYPES,
    hf_name,
    is_linear,
    rotary_heads,
)
from pdserve.engine.checkpoint.gguf_reader import GGUFFile, GGUFTensor
from pdserve.engine.checkpoint.gguf_tokenizer import GGUFVocab, build_tokenizer
from pdserve.engine.model_config import ModelConfig
from pdserve.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch

    from pdserve.engine.quant.int4_weight import Int4Weight

# The weight loaders (torch) are imported where weights are read: the configuration and the
# tokenizer (all the router reads) need only the file's metadata.

_TOKENIZER_ARRAYS = ("tokens", "token_type", "merges", "scores")
_SMALL_ARRAY = 1024  # arrays longer than this stay in the file (only their length is read)


class GGUFCheckpoint(Checkpoint):
    format = "gguf"

    def __init__(self, path: Path, model_id: str | None = None,
                 tokenizer_dir: Path | None = None) -> None:
        """`tokenizer_dir`: Hugging Face tokenizer files to use instead of the metadata's."""
        super().__init__(path)
        self._model_id = model_id
        self.tokenizer_dir = tokenizer_dir

    @property
    def model_id(self) -> str:
        return self._model_id or self.path.stem

    # -- the file --------------------------------------------------------------------------

    @cached_property
    def reader(self) -> GGUFFile:
        try:
            return GGUFFile(self.path)
        except (ValueError, OSError) as exc:
            raise ValueError(f"{self.path} is not a readable GGUF file: {exc}") from exc

    @cached_property
    def metadata(self) -> dict[str, Any]:
        """Every scalar field, small arrays as lists, `<key>.count` for large ones."""
        meta: dict[str, Any] = {}
        for key, field in self.reader.fields.items():
            if field.is_array and len(field.value) > _SMALL_ARRAY:
                meta[f"{key}.count"] = len(field.value)
                continue
            meta[key] = field.value
        if int(meta.get("split.count", 1)) > 1:
            raise ValueError(f"{self.path} is part of a split GGUF ({meta['split.count']} files): "
                             "merge it first (llama-gguf-split --merge)")
        return meta

    @cached_property
    def tensors(self) -> dict[str, GGUFTensor]:
        """name -> the file's tensor, after checking every name and type is loadable."""
        out = {}
        for t in self.reader.tensors:
            kind = t.tensor_type.name
            if kind not in SUPPORTED_TYPES:
                raise ValueError(f"GGUF tensor {t.name!r} is stored as {kind}, which pdserve "
                                 f"cannot load (supported: {', '.join(sorted(SUPPORTED_TYPES))})")
            if t.name not in CONFIG_TENSORS:
                hf_name(t.name)  # raises for a tensor the model has no place for
            out[t.name] = t
        return out

    # -- what the engine reads -----------------------------------------------------------------

    def _read_model_config(self) -> ModelConfig:
        tensors = self.tensors
        freqs = tensors.get("rope_freqs.weight")
        factors: tuple[float, ...] = ()
        if freqs is not None:  # rope scaling factors (Llama 3): the one tensor config reads
            from pdserve.engine.checkpoint.gguf_weights import dense

            factors = tuple(dense(freqs.data, freqs.tensor_type.name, freqs.shape).tolist())
        shapes = {name: t.shape for name, t in tensors.items()}
        return model_config_from_gguf(self.metadata, shapes, factors,
                                      self._float_dtype(), sorted(self.eos_token_ids))

    def _float_dtype(self) -> str:
        """The weights' own float type when every matrix has one (F16 / BF16), else float32:
        quantised values are exact in float32 and not in the half types."""
        kinds = {t.tensor_type.name for t in self.tensors.values() if len(t.dims) == 2}
        return {frozenset({"F16"}): "float16", frozenset({"BF16"}): "bfloat16"}.get(
            frozenset(kinds), "float32")

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """EOS plus llama.cpp's other end-of-generation tokens (EOT, EOM) when the file names
        them."""
        keys = ("eos_token_id", "eot_token_id", "eom_token_id")
        return frozenset(int(v) for k in keys
                         if isinstance(v := self.metadata.get(f"tokenizer.ggml.{k}"), int))

    def tokenizer(self) -> Tokenizer:
        if self.tokenizer_dir is not None:
            return Tokenizer.from_pretrained(self.tokenizer_dir)
        return build_tokenizer(self.vocab())

    def vocab(self) -> GGUFVocab:
        fields = self.reader.fields
        arrays = {name: fields[f"tokenizer.ggml.{name}"].value
                  for name in _TOKENIZER_ARRAYS if f"tokenizer.ggml.{name}" in fields}
        return GGUFVocab.from_metadata(self.metadata, arrays)

    def iter_weights(self, prefer_int4: bool = False
                     ) -> Iterator[tuple[str, torch.Tensor | Int4Weight]]:
        from pdserve.engine.checkpoint.gguf_weights import load_tensor

        cfg = self.model_config
        permuted = self.metadata["general.architecture"] in PERMUTED_ARCHITECTURES
        for name, t in self.tensors.items():
            if name in CONFIG_TENSORS:
                continue
            heads = rotary_heads(name, cfg.num_heads, cfg.num_kv_heads) if permuted else None
            yield hf_name(name), load_tensor(
                t.data, t.tensor_type.name, t.shape, linear=is_linear(name),
                prefer_int4=prefer_int4, permute_heads=heads)

    def native_quantization(self) -> str | None:
        # A Q4_0 / Q4_1 / Q4_K file is a 4-bit checkpoint, as llama.cpp and vLLM serve it; a
        # file mixing in other types (Q5_K, Q6_K, Q8_0 layers) keeps them dense instead of
        # re-quantising them to 4 bits, so it runs dense unless int4 is asked for.
        from pdserve.engine.checkpoint.gguf_int4 import INT4_TYPES

        kinds = {t.tensor_type.name for name, t in self.tensors.items() if is_linear(name)}
        return "int4" if kinds and kinds <= INT4_TYPES else None

    def weight_shapes(self) -> dict[str, list[int]]:
        return {hf_name(n): list(t.shape) for n, t in self.tensors.items()
                if n not in CONFIG_TENSORS}
