"""Typed readers for request-body fields: each returns the value or raises a `RequestError`
naming the field. Pure; shared by every endpoint's schema."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from router.openai.errors import RequestError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def boolean(fields: Mapping[str, Any], name: str, default: bool) -> bool:
    value = fields.get(name, default)
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be a boolean", name)
    return value


def integer(fields: Mapping[str, Any], name: str, default: int | None, low: int | None = None,
            high: int | None = None) -> int | None:
    """An integer in [low, high]; the range errors use pydantic's words (vLLM's clients
    match on them)."""
    value = fields.get(name, default)
    if value is None:
        return None
    if not is_int(value):
        raise RequestError(f"{name} must be an integer, got {type(value).__name__}", name)
    if low is not None and value < low:
        raise RequestError(f"{name}: Input should be greater than or equal to {low} "
                           f"[type=greater_than_equal, input_value={value}]", name)
    if high is not None and value > high:
        raise RequestError(f"{name}: Input should be less than or equal to {high} "
                           f"[type=less_than_equal, input_value={value}]", name)
    return value


def number(fields: Mapping[str, Any], name: str) -> float | None:
    value = fields.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(
            float(value)):
        raise RequestError(f"{name} must be a finite number", name)
    return float(value)


def string(fields: Mapping[str, Any], name: str) -> str | None:
    value = fields.get(name)
    if value is not None and not isinstance(value, str):
        raise RequestError(f"{name} must be a string", name)
    return value


def mapping(fields: Mapping[str, Any], name: str) -> Mapping[str, Any] | None:
    value = fields.get(name)
    if value is not None and not isinstance(value, Mapping):
        raise RequestError(f"{name} must be an object", name)
    return value


def seed(fields: Mapping[str, Any]) -> int | None:
    """vLLM takes any 64-bit signed seed; the engine's are 63-bit: fold the rest in."""
    value = integer(fields, "seed", None, INT64_MIN, INT64_MAX)
    return None if value is None else value % 2**63


def logit_bias(fields: Mapping[str, Any], vocab_size: int) -> dict[int, float]:
    """{"token id": bias} with every bad key named at once, ids in the vocabulary."""
    raw = mapping(fields, "logit_bias")
    if not raw:
        return {}
    bad_keys = [k for k in raw if not (isinstance(k, str) and k.strip().lstrip("-").isdigit())]
    if bad_keys:
        raise RequestError(f"logit_bias keys must be token ids (integers as strings), got "
                           f"{', '.join(repr(k) for k in bad_keys)}", "logit_bias")
    out: dict[int, float] = {}
    for key, value in raw.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(
                float(value)):
            raise RequestError(f"logit_bias[{key!r}] must be a number, got {value!r}",
                               "logit_bias")
        if not -100 <= value <= 100:
            raise RequestError(f"logit_bias[{key!r}] must be in [-100, 100], got {value}",
                               "logit_bias")
        out[int(key)] = float(value)
    outside = sorted(t for t in out if not 0 <= t < vocab_size)
    if outside:
        raise RequestError(f"token_id(s) {outside} in logit_bias contain out-of-vocab token "
                           f"ids. Vocabulary size: {vocab_size}", "logit_bias")
    return out
