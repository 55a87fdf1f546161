"""Our `Tokenizer` as an xgrammar `TokenizerInfo`, without importing transformers.

xgrammar needs each token's text in the tokenizer's own encoding (byte-level GPT-2 style,
SentencePiece with byte fallback, or raw) and the ids that end generation. The vocabulary type
is read from tokenizer.json's decoder, as xgrammar's Hugging Face path does.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from pdserve.tokenizer import Tokenizer


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Iterable[int]) -> Any:
    """`vocab_size` is the model's (the logits' width), which may exceed the tokenizer's."""
    import xgrammar as xgr

    encoded = [""] * vocab_size
    for token, idx in tokenizer.backend.get_vocab(with_added_tokens=True).items():
        if idx < vocab_size:
            encoded[idx] = token
    vocab_type, prefix_space = _detect(json.loads(tokenizer.backend.to_str()))
    stops = sorted(int(t) for t in stop_token_ids if 0 <= int(t) < vocab_size)
    return xgr.TokenizerInfo(encoded, getattr(xgr.VocabType, vocab_type), vocab_size=vocab_size,
                             stop_token_ids=stops or None, add_prefix_space=prefix_space)


def _detect(spec: dict) -> tuple[str, bool]:
    """(xgrammar VocabType name, add_prefix_space) from a tokenizer.json document."""
    steps = _steps(spec.get("decoder"))
    kinds = {s.get("type") for s in steps}
    if "ByteLevel" in kinds:
        return "BYTE_LEVEL", False
    if "ByteFallback" in kinds:
        prefix = any(s.get("type") == "Strip" and s.get("start") for s in steps)
        prefix = prefix or any(s.get("type") == "Metaspace" for s in _steps(spec.get("normalizer"))
                               ) or _metaspace_prefix(spec.get("pre_tokenizer"))
        return "BYTE_FALLBACK", prefix
    return "RAW", _metaspace_prefix(spec.get("pre_tokenizer"))


def _steps(node: Any) -> list[dict]:
    if not isinstance(node, dict):
        return []
    for key in ("decoders", "normalizers", "pretokenizers"):
        if isinstance(node.get(key), list):
            return [s for s in node[key] if isinstance(s, dict)]
    return [node]


def _metaspace_prefix(node: Any) -> bool:
    return any(s.get("type") == "Metaspace" and s.get("prepend_scheme", "always") != "never"
               for s in _steps(node))
