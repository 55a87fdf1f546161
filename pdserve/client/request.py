"""Turns `generate`/`stream` arguments into a `pdserve.v1.GenerateRequest`.

`GenerateOptions` holds every keyword argument of `generate`/`stream` with its default;
`GenerateKwargs` is the same set as a TypedDict, used to type `**options` on the client methods.
Validation here is limited to what the client can know on its own: types, ranges the wire types
can carry, finite floats, a non-empty prompt. Semantic limits (temperature range, context length,
...) belong to the server, which answers INVALID_ARGUMENT with the field's name.
"""

from __future__ import annotations

import math
import numbers
import operator
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TypedDict

from pdserve.client.errors import InvalidArgument
from pdserve.proto import pb

UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38

Prompt = str | Sequence[int]


@dataclass(frozen=True)
class GenerateOptions:
    """Keyword arguments of `generate` / `stream`. None means "the server's default"."""

    max_tokens: int | None = 16
    """Maximum number of tokens to generate."""
    min_tokens: int | None = None
    """Minimum number of tokens before EOS or a stop condition may end the request."""
    temperature: float | None = None
    """Softmax temperature; 0 is greedy."""
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    """Per-request seed: the same seed gives the same output wherever the request runs."""
    stop: str | Sequence[str] | None = None
    """Stop string(s): generation ends when the output contains one."""
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    """Number of top alternatives to return with each token's logprob (0: sampled token only)."""
    include_stop_str_in_output: bool = False
    request_id: str | None = None
    """Id for logs and cancellation; a fresh one (kept across retries) when None."""
    model: str = ""
    """Model id; "" is the deployment's default model."""
    timeout: float | None = None
    """Seconds for the whole call, retries included; None falls back to the client's timeout."""


class GenerateKwargs(TypedDict, total=False):
    """The keyword arguments of `generate` / `stream`; see `GenerateOptions` for each one."""

    max_tokens: int | None
    min_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    repetition_penalty: float | None
    presence_penalty: float | None
    frequency_penalty: float | None
    seed: int | None
    stop: str | Sequence[str] | None
    stop_token_ids: Sequence[int] | None
    ignore_eos: bool
    logprobs: int | None
    include_stop_str_in_output: bool
    request_id: str | None
    model: str
    timeout: float | None


_UINT32_FIELDS = ("max_tokens", "min_tokens", "logprobs")
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


def _check_int(name: str, value: object, low: int, high: int) -> int:
    try:  # operator.index also takes numpy / torch integer scalars, but not floats
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgument(f"{name}: expected an integer, got {type(value).__name__}") from None
    if not low <= value <= high:
        raise InvalidArgument(f"{name}: {value} is outside [{low}, {high}]")
    return value


def _check_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgument(f"{name}: expected a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
        raise InvalidArgument(f"{name}: must be a finite 32-bit float, got {value}")
    return value


def _token_ids(name: str, values: object) -> list[int]:
    # Any iterable of integers (list, tuple, numpy array, 1-D tensor), but not text.
    if isinstance(values, str | bytes | Mapping) or not isinstance(values, Iterable):
        raise InvalidArgument(f"{name}: expected a sequence of token ids")
    return [_check_int(f"{name}[{i}]", v, 0, UINT32_MAX) for i, v in enumerate(values)]


def _stop_strings(stop: object) -> list[str]:
    strings = [stop] if isinstance(stop, str) else stop
    if not isinstance(strings, Sequence) or not all(isinstance(s, str) for s in strings):
        raise InvalidArgument("stop: expected a string or a sequence of strings")
    if any(s == "" for s in strings):
        raise InvalidArgument("stop: stop strings must not be empty")
    return list(strings)


def sampling_params(options: GenerateOptions) -> pb.SamplingParams:
    """The SamplingParams message for options (unset optional fields stay unset)."""
    params = pb.SamplingParams(
        ignore_eos=bool(options.ignore_eos),
        include_stop_str_in_output=bool(options.include_stop_str_in_output),
    )
    for name in _UINT32_FIELDS:
        if (value := getattr(options, name)) is not None:
            setattr(params, name, _check_int(name, value, 0, UINT32_MAX))
    for name in _FLOAT_FIELDS:
        if (value := getattr(options, name)) is not None:
            setattr(params, name, _check_float(name, value))
    if options.top_k is not None:
        params.top_k = _check_int("top_k", options.top_k, INT32_MIN, INT32_MAX)
    if options.seed is not None:
        params.seed = _check_int("seed", options.seed, 0, UINT64_MAX)
    if options.stop is not None:
        params.stop.extend(_stop_strings(options.stop))
    if options.stop_token_ids is not None:
        params.stop_token_ids.extend(_token_ids("stop_token_ids", options.stop_token_ids))
    return params


def build_request(prompt: Prompt, options: GenerateOptions) -> pb.GenerateRequest:
    """The GenerateRequest for a prompt (text or token ids); raises InvalidArgument."""
    request_id = options.request_id if options.request_id is not None else uuid.uuid4().hex
    if not isinstance(request_id, str):
        raise InvalidArgument("request_id: expected a string")
    if not isinstance(options.model, str):
        raise InvalidArgument("model: expected a string")
    request = pb.GenerateRequest(
        request_id=request_id, model=options.model, sampling=sampling_params(options)
    )
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(_token_ids("prompt", prompt))
    if not (request.text or request.token_ids.ids):
        raise InvalidArgument("prompt: must not be empty")
    return request


def make_options(kwargs: GenerateKwargs) -> GenerateOptions:
    """GenerateOptions from keyword arguments, naming any unknown one."""
    known = {f.name for f in fields(GenerateOptions)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise TypeError(f"unexpected keyword argument(s): {', '.join(unknown)}")
    return GenerateOptions(**kwargs)
