"""Turns `generate`/`stream` arguments into a `pdserve.v1.GenerateRequest`.

`GenerateOptions` holds every keyword argument of `generate`/`stream` with its default;
`GenerateKwargs` is the same set as a TypedDict, used to type `**options` on the client methods.
Validation here is limited to what the client can know on its own: types, ranges the wire types
can carry, finite floats, a non-empty prompt. Semantic limits (temperature range, context length,
...) belong to the server, which answers INVALID_ARGUMENT with the field's name.
"""

from __future__ import annotations

import json
import math
import numbers
import operator
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, TypedDict

from pdserve.client.datatypes import Chat
from pdserve.client.errors import InvalidArgument
from pdserve.proto import pb

UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38

Prompt = str | Sequence[int] | Chat


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
    n: int | None = None
    """Choices for the prompt (generate_choices / stream); they share the prompt."""
    logit_bias: Mapping[int, float] | None = None
    """Added to these token ids' logits, each in [-100, 100]."""
    prompt_logprobs: int | None = None
    """Logprobs of the prompt's tokens, with this many alternatives each."""
    allowed_token_ids: Sequence[int] | None = None
    """Sample only among these token ids."""
    bad_words_token_ids: Sequence[Sequence[int]] | None = None
    """Token sequences never to generate (the last token of each is banned after the rest)."""
    json_schema: Mapping[str, Any] | str | None = None
    """Constrain the output to JSON valid against this schema (at most one constraint)."""
    json_object: bool = False
    """Constrain the output to a JSON object."""
    regex: str | None = None
    """Constrain the output to match this regular expression."""
    choice: Sequence[str] | None = None
    """Constrain the output to one of these strings."""
    grammar: str | None = None
    """Constrain the output to this EBNF grammar (root rule `root`)."""
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
    n: int | None
    logit_bias: Mapping[int, float] | None
    prompt_logprobs: int | None
    allowed_token_ids: Sequence[int] | None
    bad_words_token_ids: Sequence[Sequence[int]] | None
    json_schema: Mapping[str, Any] | str | None
    json_object: bool
    regex: str | None
    choice: Sequence[str] | None
    grammar: str | None
    request_id: str | None
    model: str
    timeout: float | None


_UINT32_FIELDS = ("max_tokens", "min_tokens", "logprobs", "prompt_logprobs")
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
    for tid, bias in (options.logit_bias or {}).items():
        params.logit_bias[_check_int("logit_bias", tid, 0, UINT32_MAX)] = _check_float(
            "logit_bias", bias)
    if options.allowed_token_ids is not None:
        params.allowed_token_ids.extend(_token_ids("allowed_token_ids",
                                                   options.allowed_token_ids))
    for i, seq in enumerate(options.bad_words_token_ids or ()):
        params.bad_words_token_ids.add(ids=_token_ids(f"bad_words_token_ids[{i}]", seq))
    structured = _structured(options)
    if structured is not None:
        params.structured.CopyFrom(structured)
    return params


def _structured(o: GenerateOptions) -> pb.StructuredOutput | None:
    given = [name for name in ("json_schema", "regex", "choice", "grammar")
             if getattr(o, name) is not None] + (["json_object"] if o.json_object else [])
    if len(given) > 1:
        raise InvalidArgument(f"give at most one output constraint, not {', '.join(given)}")
    if not given:
        return None
    if o.json_schema is not None:
        text = o.json_schema if isinstance(o.json_schema, str) else json.dumps(o.json_schema)
        return pb.StructuredOutput(json_schema=text)
    if o.json_object:
        return pb.StructuredOutput(json_object=True)
    if o.choice is not None:
        if isinstance(o.choice, str) or not all(isinstance(c, str) for c in o.choice):
            raise InvalidArgument("choice: expected a sequence of strings")
        return pb.StructuredOutput(choice=pb.Choices(choices=list(o.choice)))
    name = given[0]
    if not isinstance(getattr(o, name), str):
        raise InvalidArgument(f"{name}: expected a string")
    return pb.StructuredOutput(**{name: getattr(o, name)})


def _chat(chat: Chat) -> pb.ChatPrompt:
    msg = pb.ChatPrompt(add_generation_prompt=bool(chat.add_generation_prompt),
                        continue_final_message=bool(chat.continue_final_message),
                        tool_choice=chat.tool_choice or "",
                        chat_template_kwargs_json=json.dumps(dict(chat.chat_template_kwargs)))
    for i, m in enumerate(chat.messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise InvalidArgument(f"messages[{i}]: expected a dict with a role")
        content = m.get("content") or ""
        if not isinstance(content, str):
            raise InvalidArgument(f"messages[{i}].content: expected a string")
        calls = [pb.ToolCall(id=str(c.get("id", "")), name=c["function"]["name"],
                             arguments_json=_json_text(c["function"].get("arguments", "{}")))
                 for c in m.get("tool_calls") or ()]
        msg.messages.append(pb.ChatMessage(role=m["role"], content=content,
                                           name=m.get("name") or "", tool_calls=calls,
                                           tool_call_id=m.get("tool_call_id") or ""))
    for t in chat.tools:
        fn = t.get("function", t) if isinstance(t, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise InvalidArgument("tools: expected {\"type\": \"function\", \"function\": "
                                  "{\"name\": ..., \"parameters\": {...}}}")
        params = fn.get("parameters")
        msg.tools.append(pb.Tool(name=fn["name"], description=fn.get("description") or "",
                                 parameters_json=json.dumps(params) if params else ""))
    if not msg.messages:
        raise InvalidArgument("messages: must not be empty")
    return msg


def _json_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def build_request(prompt: Prompt, options: GenerateOptions) -> pb.GenerateRequest:
    """The GenerateRequest for a prompt (text or token ids); raises InvalidArgument."""
    request_id = options.request_id if options.request_id is not None else uuid.uuid4().hex
    if not isinstance(request_id, str):
        raise InvalidArgument("request_id: expected a string")
    if not isinstance(options.model, str):
        raise InvalidArgument("model: expected a string")
    request = pb.GenerateRequest(
        request_id=request_id, model=options.model, sampling=sampling_params(options),
        n=_check_int("n", options.n, 1, 128) if options.n is not None else 0,
    )
    if isinstance(prompt, Chat):
        request.chat.CopyFrom(_chat(prompt))
        return request
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
