"""A GGUF prepared for fast starts: the same weights, the vocabulary moved to tokenizer files.

Every process that opens a GGUF (router, each worker rank) reads its metadata, while the
vocabulary is needed only to build the tokenizer, which takes a second or more from the arrays
(gguf_tokenizer.py) and milliseconds from a tokenizer.json. A prepared directory therefore
holds

    <name>.gguf            every tensor byte for byte and every metadata field except
                           tokenizer.ggml.{tokens, token_type, merges, scores}
    tokenizer.json         the tokenizer built from the full file (gguf_tokenizer.py), in
    tokenizer_config.json  Hugging Face form; `open_checkpoint(dir)` uses it
    generation_config.json (EOS ids)

`prepare_gguf_dir` writes it and checks it against the source before returning: same tensors
(names, types, shapes, bytes), same config, same tokenizer on a probe text.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from pdserve.engine.checkpoint.gguf_file import GGUFCheckpoint

_VOCAB_ARRAYS = tuple(f"tokenizer.ggml.{k}" for k in ("tokens", "token_type", "merges", "scores"))
_WRITER_OWNS = ("general.architecture",)
_PROBE = "Hello, world! 12 + 30 = 42.\n\tdef f(x):\n    return x  # café, 東京 🙂"


def prepare_gguf_dir(source: GGUFCheckpoint, out_dir: Path, file_name: str,
                     step: Callable[[str], None] = lambda _: None) -> None:
    """Write the prepared form of `source` into `out_dir` (which must exist and be private to
    the caller: it is not written atomically here). `step` is told each stage's name."""
    step("reading the vocabulary")
    tokenizer = source.tokenizer()
    step("writing the weights")
    target = out_dir / file_name
    _write_without_vocab(source, target)
    tokenizer.save_pretrained(out_dir)
    step("checking the prepared copy")
    _check_same(source, GGUFCheckpoint(target, tokenizer_dir=out_dir), tokenizer)


def _write_without_vocab(source: GGUFCheckpoint, target: Path) -> None:
    import gguf

    reader = source.reader
    writer = gguf.GGUFWriter(target, arch=source.metadata["general.architecture"])
    for key, field in reader.fields.items():
        if key in _WRITER_OWNS or key in _VOCAB_ARRAYS:
            continue
        writer.add_key_value(key, field.value, field.type, sub_type=field.item_type)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _check_same(source: GGUFCheckpoint, prepared: GGUFCheckpoint, tokenizer) -> None:
    if prepared.model_config != source.model_config:
        raise RuntimeError(f"prepared {prepared.path} reads as another model config")
    want, got = source.reader.tensors, prepared.reader.tensors
    if [(t.name, t.tensor_type, t.dims) for t in want] != [
            (t.name, t.tensor_type, t.dims) for t in got]:
        raise RuntimeError(f"prepared {prepared.path} lists other tensors than {source.path}")
    for a, b in zip(want, got, strict=True):
        if not np.array_equal(np.asarray(a.data), np.asarray(b.data)):
            raise RuntimeError(f"prepared {prepared.path}: tensor {a.name} differs")
    loaded = prepared.tokenizer()
    if (loaded.encode(_PROBE) != tokenizer.encode(_PROBE)
            or loaded.eos_token_ids != tokenizer.eos_token_ids
            or loaded.vocab_size != tokenizer.vocab_size):
        raise RuntimeError(f"prepared tokenizer in {prepared.path.parent} differs")
