"""Checkpoint formats behind one interface (`Checkpoint`, see base.py).

    open_checkpoint(path)
        a directory with config.json      -> HFCheckpoint   (hf.py: safetensors)
        a GGUF file (by its magic bytes)   -> GGUFCheckpoint (gguf_file.py)
        a directory holding one .gguf      -> GGUFCheckpoint, served under the directory's name;
                                              its tokenizer.json, if any, is the tokenizer

The format is decided by what is on disk, never by a quantisation scheme; a quantisation is
chosen by configuration (`EngineConfig.quantization`), whatever the format.
"""

from __future__ import annotations

from pathlib import Path

from pdserve.engine.checkpoint.base import Checkpoint

GGUF_MAGIC = b"GGUF"


def open_checkpoint(path: str | Path) -> Checkpoint:
    """The checkpoint at `path`; ValueError (naming the path) for anything else."""
    p = Path(path).expanduser()
    if p.is_file():
        with open(p, "rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise ValueError(f"model path {p} is a file but not a GGUF file: give a Hugging "
                             "Face checkpoint directory, a .gguf file or a directory holding one")
        from pdserve.engine.checkpoint.gguf_file import GGUFCheckpoint

        return GGUFCheckpoint(p)
    if not p.is_dir():
        raise ValueError(f"model path {p} does not exist")
    if (p / "config.json").is_file():
        from pdserve.engine.checkpoint.hf import HFCheckpoint

        return HFCheckpoint(p)
    ggufs = sorted(f for f in p.iterdir() if f.suffix.lower() == ".gguf" and f.is_file())
    if len(ggufs) == 1:
        from pdserve.engine.checkpoint.gguf_file import GGUFCheckpoint

        tokenizer_dir = p if (p / "tokenizer.json").is_file() else None
        return GGUFCheckpoint(ggufs[0], model_id=p.name, tokenizer_dir=tokenizer_dir)
    if ggufs:
        raise ValueError(f"model path {p} holds {len(ggufs)} .gguf files "
                         f"({', '.join(f.name for f in ggufs[:4])}): give one of them")
    raise ValueError(f"model path {p} has neither a config.json (Hugging Face checkpoint) nor "
                     "a .gguf file")


__all__ = ["Checkpoint", "open_checkpoint"]
