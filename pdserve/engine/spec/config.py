"""Speculative decoding configuration: the vLLM-style dict, parsed once into a frozen dataclass.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    {"model": "/path/to/draft", "num_speculative_tokens": 4}      # method "draft_model"
    {"method": "eagle" | "eagle3" | "medusa", "model": HEAD_DIR, "num_speculative_tokens": 3}
    {"method": "mtp", "num_speculative_tokens": 1}    # the target's own MTP layers

Every key is validated here; an unknown key or a bad value raises `ValueError` naming the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp", "medusa")
HEAD_METHODS = ("eagle", "eagle3", "medusa")  # a head checkpoint directory in `model`
_ALIASES = {"deepseek_mtp": "mtp", "eagle-3": "eagle3"}


@dataclass(frozen=True)
class SpecConfig:
    method: str
    """ngram (prompt lookup, no model), draft_model (a smaller model, same tokenizer),
    eagle / eagle3 / medusa (a learned head in `model`, reading the target's hidden states),
    or mtp (the target checkpoint's own multi-token-prediction layers)."""
    num_speculative_tokens: int
    """k: most draft tokens verified per request per step (the adaptive policy may use fewer)."""
    prompt_lookup_max: int = 3
    """ngram: longest suffix n-gram to look up."""
    prompt_lookup_min: int = 1
    """ngram: shortest suffix n-gram to look up."""
    model: str | None = None
    """draft_model: checkpoint directory of the draft (its vocabulary must be the target's);
    eagle / eagle3 / medusa: the head's directory (config.json + safetensors); mtp: where
    the MTP layers are (default: the target checkpoint)."""
    draft_greedy: bool = False
    """draft_model: draft the argmax even for sampled requests (q is then one-hot); by default
    the draft samples with the request's own parameters and q is its sampling distribution."""
    draft_num_gpu_blocks: int | None = None
    """draft_model and the heads with attention (eagle, eagle3, mtp): KV blocks of the
    drafter's own cache; None = the target's count plus one per sequence slot (the drafter
    holds at most as many tokens per request as the target, plus k)."""
    adaptive: bool = True
    """Choose k per step from the batch size and measured acceptance (see `adaptive.py`);
    False always proposes num_speculative_tokens."""
    compute_bound_tokens: int | None = None
    """Adaptive cost model: tokens per forward at which the device turns compute-bound;
    None = a per-device default (`adaptive.default_compute_bound_tokens`)."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, "
                             f"got {self.method!r}")
        _positive_int("num_speculative_tokens", self.num_speculative_tokens)
        _positive_int("prompt_lookup_max", self.prompt_lookup_max)
        _positive_int("prompt_lookup_min", self.prompt_lookup_min)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) "
                             f"must be <= prompt_lookup_max ({self.prompt_lookup_max})")
        if self.method in ("draft_model", *HEAD_METHODS) and not self.model:
            raise ValueError(f"speculative_config.model (the draft checkpoint) is required for "
                             f"method {self.method!r}")
        if self.method == "ngram" and self.model:
            raise ValueError("speculative_config.model must not be set for method 'ngram'")
        if self.draft_num_gpu_blocks is not None:
            _positive_int("draft_num_gpu_blocks", self.draft_num_gpu_blocks)
        if self.compute_bound_tokens is not None:
            _positive_int("compute_bound_tokens", self.compute_bound_tokens)
        for name in ("draft_greedy", "adaptive"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"speculative_config.{name} must be a bool, "
                                 f"got {getattr(self, name)!r}")

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> SpecConfig:
        """Parse the vLLM-style dict; `method` defaults to draft_model when `model` is set."""
        if not isinstance(raw, Mapping):
            raise ValueError(f"speculative_config must be a dict, got {type(raw).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; "
                             f"known: {sorted(known)}")
        values = dict(raw)
        if "num_speculative_tokens" not in values:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        values.setdefault("method", "draft_model" if values.get("model") else "ngram")
        values["method"] = _ALIASES.get(values["method"], values["method"])
        if values.get("model") is not None:
            values["model"] = str(values["model"])
        return cls(**values)


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"speculative_config.{name} must be a positive integer, got {value!r}")
