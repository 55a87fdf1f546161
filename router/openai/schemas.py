"""OpenAI request bodies -> typed, validated requests. Pure: no I/O, no tokenizer.

Owns which fields each endpoint accepts, their JSON types, and how they become one
`SamplingParams`. Every failure is a `RequestError` naming the field (HTTP 400). A field sent
as `null` counts as absent (client libraries send explicit nulls); any other field this server
does not know is refused rather than silently ignored. A model other than the served one is an
`ApiError` 404, as OpenAI answers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdserve.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from router.openai.errors import RequestError, model_not_found
from router.validation import RequestLimits, check_params, check_text

COMPLETION_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default for /v1/completions; chat completions default to the model's context."""

# Request fields that go straight into SamplingParams under the same name.
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos",
             "min_tokens", "include_stop_str_in_output")
_COMMON = frozenset({*_SAMPLING, "model", "max_tokens", "stream", "stream_options", "n",
                     "user", "logit_bias"})
COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs",
                         "response_format", "tools", "tool_choice", "functions",
                         "function_call", "parallel_tool_calls"}
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


@dataclass(frozen=True)
class ServedModel:
    """What the router serves, as the HTTP API describes it."""

    id: str
    max_model_len: int
    """Prompt + completion tokens the workers accept."""
    vocab_size: int
    created: int
    """Unix time the router started (the `created` of /v1/models)."""
    max_token_bytes: int = 4
    """Bytes of the tokenizer's longest token (`RequestLimits`)."""

    @property
    def limits(self) -> RequestLimits:
        return RequestLimits(self.max_model_len, self.vocab_size, self.max_token_bytes)


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str | tuple[int, ...]
    """One text prompt, or one prompt as token ids."""
    params: SamplingParams
    stream: bool
    include_usage: bool
    """Streaming: send a last chunk with `usage` (stream_options.include_usage)."""


@dataclass(frozen=True)
class ChatRequest:
    messages: tuple[dict[str, str], ...]
    """Each {"role", "content"[, "name"]}, content flattened to text."""
    params: SamplingParams
    stream: bool
    include_usage: bool
    logprobs: bool
    """Return chat-format logprobs (params.logprobs holds top_logprobs)."""


def parse_completion(body: Any, model: ServedModel) -> CompletionRequest:
    fields = _fields(body, COMPLETION_FIELDS)
    _check_common(fields, model)
    if fields.get("echo") not in (None, False):
        raise RequestError("echo is not supported", "echo")
    if fields.get("best_of") not in (None, 1):
        raise RequestError("best_of must be 1", "best_of")
    if fields.get("suffix") not in (None, ""):
        raise RequestError("suffix is not supported", "suffix")
    logprobs = fields.get("logprobs")
    if logprobs is not None and not _is_int(logprobs):
        raise RequestError("logprobs must be an integer", "logprobs")
    params = _sampling(fields, model, "max_tokens", COMPLETION_DEFAULT_MAX_TOKENS, logprobs)
    stream, usage = _stream(fields)
    prompt = _prompt(fields.get("prompt"))
    if isinstance(prompt, str):
        check_text(prompt, model.limits, "prompt")  # before anyone tokenises it
    return CompletionRequest(prompt, params, stream, usage)


def parse_chat(body: Any, model: ServedModel) -> ChatRequest:
    fields = _fields(body, CHAT_FIELDS)
    _check_common(fields, model)
    for name in ("tools", "functions"):
        if fields.get(name):
            raise RequestError(f"{name} are not supported", name)
    for name in ("tool_choice", "function_call"):
        if fields.get(name) not in (None, "none"):
            raise RequestError(f"{name} is not supported", name)
    fmt = fields.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise RequestError("response_format must be {\"type\": \"text\"}", "response_format")
    want_lp, top = _chat_logprobs(fields)
    max_field = "max_completion_tokens" if "max_completion_tokens" in fields else "max_tokens"
    params = _sampling(fields, model, max_field, model.max_model_len, top if want_lp else None)
    stream, usage = _stream(fields)
    messages = _messages(fields.get("messages"))
    # The contents bound the rendered prompt's tokens from below, as a text's bytes do.
    check_text("\n".join(m["content"] for m in messages) or " ", model.limits, "messages")
    return ChatRequest(messages, params, stream, usage, want_lp)


def parse_json_body(raw: bytes) -> Any:
    """Strict JSON: UTF-8, no NaN/Infinity, no duplicate keys."""
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_no_constant,
                          object_pairs_hook=_no_duplicates)
    except UnicodeDecodeError:
        raise RequestError("the request body is not UTF-8") from None
    except RecursionError:
        raise RequestError("the request body is nested too deeply") from None
    except ValueError as exc:
        raise RequestError(f"the request body is not valid JSON: {exc}") from None


# -- helpers -------------------------------------------------------------------------------------


def _fields(body: Any, allowed: frozenset[str]) -> dict[str, Any]:
    if not isinstance(body, Mapping):
        raise RequestError(f"the request body must be a JSON object, got "
                           f"{type(body).__name__}")
    fields = {k: v for k, v in body.items() if v is not None}
    unknown = sorted(k for k in fields if k not in allowed)
    if unknown:
        raise RequestError(f"unrecognized request argument(s): {', '.join(unknown)}",
                           unknown[0])
    return fields


def _check_common(fields: dict[str, Any], model: ServedModel) -> None:
    name = fields.get("model", model.id)
    if not isinstance(name, str):
        raise RequestError("model must be a string", "model")
    if name != model.id:
        raise model_not_found(name, model.id)
    n = fields.get("n", 1)
    if not _is_int(n) or n != 1:
        raise RequestError("n must be 1 (one choice per request)", "n")
    if fields.get("logit_bias"):
        raise RequestError("logit_bias is not supported", "logit_bias")
    if "user" in fields and not isinstance(fields["user"], str):
        raise RequestError("user must be a string", "user")


def _sampling(fields: dict[str, Any], model: ServedModel, max_field: str, max_default: int,
              logprobs: int | None) -> SamplingParams:
    max_tokens = fields.get(max_field, max_default)
    kwargs = {name: fields[name] for name in _SAMPLING if name in fields}
    try:
        params = SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **kwargs)
        params.validate_for_model(model.vocab_size)
    except ValueError as exc:  # SamplingParams' messages start with the field's name
        first = str(exc).split(" ", 1)[0]
        param = max_field if first == "max_tokens" else first if first in fields else None
        raise RequestError(str(exc), param) from None
    check_params(params, model.limits, max_field)  # the limits gRPC requests meet too
    return params


def _stream(fields: dict[str, Any]) -> tuple[bool, bool]:
    stream = fields.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("stream must be a boolean", "stream")
    opts = fields.get("stream_options", {})
    if not isinstance(opts, Mapping) or set(opts) - {"include_usage"}:
        raise RequestError("stream_options must be an object with only include_usage",
                           "stream_options")
    usage = opts.get("include_usage", False)
    if not isinstance(usage, bool):
        raise RequestError("stream_options.include_usage must be a boolean", "stream_options")
    return stream, usage


def _chat_logprobs(fields: dict[str, Any]) -> tuple[bool, int]:
    want = fields.get("logprobs", False)
    if not isinstance(want, bool):
        raise RequestError("logprobs must be a boolean", "logprobs")
    top = fields.get("top_logprobs", 0)
    if not _is_int(top) or not 0 <= top <= MAX_LOGPROBS:
        raise RequestError(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}]",
                           "top_logprobs")
    if top and not want:
        raise RequestError("top_logprobs needs logprobs set to true", "top_logprobs")
    return want, top


def _prompt(prompt: Any) -> str | tuple[int, ...]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("prompt must not be empty", "prompt")
        return prompt
    if isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        return tuple(prompt)
    if isinstance(prompt, list) and all(isinstance(p, str | list) for p in prompt):
        raise RequestError("batched prompts are not supported: send one prompt per request",
                           "prompt")
    if prompt is None:
        raise RequestError("prompt is required", "prompt")
    raise RequestError("prompt must be a string or a list of token ids", "prompt")


def _messages(messages: Any) -> tuple[dict[str, str], ...]:
    if messages is None:
        raise RequestError("messages is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", "messages")
    return tuple(_message(i, m) for i, m in enumerate(messages))


def _message(i: int, m: Any) -> dict[str, str]:
    where = f"messages[{i}]"
    if not isinstance(m, Mapping):
        raise RequestError(f"{where} must be an object", "messages")
    unknown = sorted(set(m) - {"role", "content", "name"})
    if unknown:
        raise RequestError(f"{where} has unsupported field(s): {', '.join(unknown)}",
                           "messages")
    role = m.get("role")
    if role not in _ROLES:
        raise RequestError(f"{where}.role must be one of {sorted(_ROLES)}", "messages")
    out = {"role": role, "content": _content(where, m.get("content"))}
    if m.get("name") is not None:
        if not isinstance(m["name"], str):
            raise RequestError(f"{where}.name must be a string", "messages")
        out["name"] = m["name"]
    return out


def _content(where: str, content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or a list of parts", "messages")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, Mapping) or part.get("type") != "text" \
                or not isinstance(part.get("text"), str):
            raise RequestError(f"{where}.content[{j}] must be a text part "
                               '({"type": "text", "text": ...})', "messages")
        texts.append(part["text"])
    return "\n".join(texts)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"duplicate key {dup!r}")
    return out


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
