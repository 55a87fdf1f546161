"""Per-request sampling parameters: one frozen, validated value that travels on the wire.

This module owns `SamplingParams` — its fields and defaults (vLLM's conventions), the
validation of every field (a `ValueError` whose message starts with the field's name), and its
plain-dict form for msgpack (`to_dict` / `from_dict`). It does no sampling itself: the sampler
reads these values, the engine enforces stops and lengths.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdserve.engine.structured.spec import StructuredOutput

MAX_LOGPROBS = 20
"""Largest top-n a request may ask for (`logprobs`)."""

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this are greedy."""

LOGIT_BIAS_LIMIT = 100.0
"""Largest |bias| one logit_bias entry may add (OpenAI's range)."""

_SEED_LIMIT = 2**63


@dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are chosen and when its generation stops.

    Construct with keywords. List-valued fields accept any sequence and are stored as tuples;
    float fields accept ints and are stored as floats; `top_k=-1` is stored as 0 (disabled).
    """

    max_tokens: int = 16
    """Most tokens to generate (>= 1)."""
    min_tokens: int = 0
    """Tokens to generate before EOS / `stop_token_ids` may be sampled (<= max_tokens)."""
    temperature: float = 1.0
    """Softmax temperature (>= 0); 0 (or below GREEDY_TEMPERATURE) means greedy."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest top set whose mass reaches top_p, in (0, 1]."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 (or -1 on input) disables it."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's, in [0, 1]."""
    repetition_penalty: float = 1.0
    """> 0; logits of tokens seen in prompt or output are divided (if > 0) / multiplied by it."""
    presence_penalty: float = 0.0
    """In [-2, 2]; subtracted once from the logit of every token already generated."""
    frequency_penalty: float = 0.0
    """In [-2, 2]; subtracted per occurrence from the logit of every generated token."""
    seed: int | None = None
    """Makes the request's draws reproducible, in [0, 2**63); None lets the engine pick one."""
    stop: tuple[str, ...] = ()
    """Stop strings (non-empty); a bare string is taken as a one-element tuple."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end generation (in addition to EOS unless ignore_eos)."""
    ignore_eos: bool = False
    """Keep generating past EOS."""
    logprobs: int | None = None
    """None: no logprobs; 0: the chosen token's; n: plus the top n (n <= 20)."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of the output text."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the logits before sampling, bias in [-100, 100]; a
    mapping is accepted and stored sorted by token id."""
    prompt_logprobs: int | None = None
    """None: none; n: the logprob of every prompt token after the first, plus the top n
    (n <= 20). Such a request skips the prefix cache: every position must be computed."""
    structured: StructuredOutput | None = None
    """Constrain the output to a grammar (JSON schema, regex, choice, EBNF; see
    `pdserve.engine.structured`)."""
    allowed_token_ids: tuple[int, ...] = ()
    """Sample only among these tokens (vLLM's allowed_token_ids); empty: every token."""
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    """Banned token sequences (vLLM's bad_words, tokenized by the caller): the last token
    of each is masked whenever the output ends with the ones before it."""

    def __post_init__(self) -> None:
        self._normalise()
        self._validate_lengths()
        self._validate_distribution()
        self._validate_penalties()
        self._validate_stops()
        self._validate_misc()

    @property
    def is_greedy(self) -> bool:
        """True when the token is always the (penalised) argmax.

        Like vLLM, a temperature below GREEDY_TEMPERATURE counts as 0: dividing logits by it
        would overflow to inf and the distribution would be argmax anyway.
        """
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    def to_dict(self) -> dict[str, Any]:
        """Plain msgpack-able values (tuples become lists); inverse of `from_dict`."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        out["logit_bias"] = [list(pair) for pair in self.logit_bias]
        out["bad_words_token_ids"] = [list(seq) for seq in self.bad_words_token_ids]
        out["structured"] = self.structured.to_dict() if self.structured is not None else None
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SamplingParams:
        """Rebuild from `to_dict` output; missing keys take defaults, unknown keys are an error."""
        if not isinstance(d, Mapping):
            raise ValueError(f"sampling params must be a mapping, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in d if k not in known)
        if unknown:
            raise ValueError(f"unknown sampling params field(s): {', '.join(unknown)}")
        d = dict(d)
        if d.get("structured") is not None:
            d["structured"] = StructuredOutput.from_dict(d["structured"])
        if d.get("logit_bias") is not None:
            d["logit_bias"] = tuple(tuple(pair) for pair in d["logit_bias"])
        return cls(**d)

    def validate_for_model(self, vocab_size: int) -> None:
        """Check the fields that depend on the model: every stop token id < vocab_size."""
        _require_int("vocab_size", vocab_size)
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        for tid in self.stop_token_ids:
            if tid >= vocab_size:
                raise ValueError(
                    f"stop_token_ids must be < vocab_size ({vocab_size}), got {tid}"
                )
        bad = [tid for tid, _ in self.logit_bias if tid >= vocab_size]
        if bad:
            raise ValueError(f"logit_bias has token ids outside [0, {vocab_size}): {bad[:5]}")
        bad = [tid for tid in self.allowed_token_ids if tid >= vocab_size]
        if bad:
            raise ValueError(f"allowed_token_ids contains out-of-vocab token ids (vocabulary "
                             f"size {vocab_size}): {bad[:5]}")
        bad = [tid for seq in self.bad_words_token_ids for tid in seq if tid >= vocab_size]
        if bad:
            raise ValueError(f"bad_words_token_ids contains out-of-vocab token ids "
                             f"(vocabulary size {vocab_size}): {bad[:5]}")

    # -- validation helpers (each checks one group of fields) --------------------------------

    def _normalise(self) -> None:
        # Frozen dataclass: normalised values are written once, here, before anyone can see them.
        set_ = lambda name, value: object.__setattr__(self, name, value)
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            set_(name, _require_float(name, getattr(self, name)))
        if isinstance(self.stop, str):
            set_("stop", (self.stop,))
        set_("stop", _require_tuple("stop", self.stop))
        set_("stop_token_ids", _require_tuple("stop_token_ids", self.stop_token_ids))
        if type(self.top_k) is int and self.top_k == -1:
            set_("top_k", 0)
        set_("logit_bias", _logit_bias(self.logit_bias))
        set_("allowed_token_ids", _require_tuple("allowed_token_ids", self.allowed_token_ids))
        bad = _require_tuple("bad_words_token_ids", self.bad_words_token_ids)
        set_("bad_words_token_ids", tuple(_require_tuple("bad_words_token_ids", seq)
                                          for seq in bad))

    def _validate_lengths(self) -> None:
        _require_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        _require_int("min_tokens", self.min_tokens)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )

    def _validate_distribution(self) -> None:
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _require_int("top_k", self.top_k)
        if self.top_k < 0:
            raise ValueError(f"top_k must be -1, 0 (disabled) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    def _validate_penalties(self) -> None:
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")

    def _validate_stops(self) -> None:
        for s in self.stop:
            if not isinstance(s, str):
                raise ValueError(f"stop must contain strings, got {type(s).__name__}")
            if not s:
                raise ValueError("stop must not contain empty strings")
        for tid in self.stop_token_ids:
            _require_int("stop_token_ids", tid)
            if tid < 0:
                raise ValueError(f"stop_token_ids must be >= 0, got {tid}")
        self._validate_masks()

    def _validate_masks(self) -> None:
        for tid in self.allowed_token_ids:
            _require_int("allowed_token_ids", tid)
            if tid < 0:
                raise ValueError(f"allowed_token_ids must be >= 0, got {tid}")
        for seq in self.bad_words_token_ids:
            if not seq:
                raise ValueError("bad_words_token_ids must not contain empty sequences")
            for tid in seq:
                _require_int("bad_words_token_ids", tid)
                if tid < 0:
                    raise ValueError(f"bad_words_token_ids must be >= 0, got {tid}")

    def _validate_misc(self) -> None:
        if self.seed is not None:
            _require_int("seed", self.seed)
            if not 0 <= self.seed < _SEED_LIMIT:
                raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _require_int(name, value)
                if not 0 <= value <= MAX_LOGPROBS:
                    raise ValueError(
                        f"{name} must be None or in [0, {MAX_LOGPROBS}], got {value}")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError(f"structured must be a StructuredOutput, got "
                             f"{type(self.structured).__name__}")


def _require_int(name: str, value: object) -> None:
    # bool is an int subclass; True as a token count is always a caller bug.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")


def _require_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {type(value).__name__}")
    try:
        as_float = float(value)
    except OverflowError:
        as_float = math.inf
    if not math.isfinite(as_float):
        raise ValueError(f"{name} must be finite, got {value}")
    return as_float


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    pairs = value.items() if isinstance(value, Mapping) else value
    if not isinstance(pairs, list | tuple | type({}.items())):
        raise ValueError(f"logit_bias must be a mapping or (token id, bias) pairs, got "
                         f"{type(value).__name__}")
    out: dict[int, float] = {}
    for pair in pairs:
        if not isinstance(pair, list | tuple) or len(pair) != 2:
            raise ValueError("logit_bias entries must be (token id, bias) pairs")
        tid, bias = pair
        _require_int("logit_bias token id", tid)
        if tid < 0:
            raise ValueError(f"logit_bias token ids must be >= 0, got {tid}")
        bias = _require_float("logit_bias value", bias)
        if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
            raise ValueError(f"logit_bias values must be in [-{LOGIT_BIAS_LIMIT:g}, "
                             f"{LOGIT_BIAS_LIMIT:g}], got {bias}")
        out[tid] = bias
    return tuple(sorted(out.items()))


def _require_tuple(name: str, value: object) -> tuple:
    if not isinstance(value, list | tuple):
        raise ValueError(f"{name} must be a list or tuple, got {type(value).__name__}")
    return tuple(value)
