"""OpenAI request bodies -> typed, validated requests. Pure: no I/O, no tokenizer.

Tolerant where vLLM is, strict where it matters:
- a field sent as `null` counts as absent (client libraries send explicit nulls);
- a field this server does not know is accepted and ignored; the handler logs its name once
  (`IgnoredFields`), as vLLM warns about the fields it drops;
- known fields keep their type and range checks, each failure a `RequestError` naming the
  field (HTTP 400); a known field whose meaning cannot be honoured (a request chat template,
  non-text content) is refused rather than silently ignored;
- vLLM's extras are accepted and honoured: sampling knobs (`top_k`, `min_p`,
  `repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids`, ...), output knobs
  (`skip_special_tokens`, `return_token_ids`, `return_tokens_as_token_ids`,
  `prompt_logprobs`, `truncate_prompt_tokens`, `request_id`), chat template knobs
  (`add_generation_prompt`, `continue_final_message`, `add_special_tokens`,
  `chat_template_kwargs`, `echo`), structured outputs (`constraints.py`) and
  `stream_options.continuous_usage_stats`.
A model other than the served one is an `ApiError` 404, as OpenAI answers.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from router.openai import constraints
from router.openai import fields as f
from router.openai.errors import RequestError, model_not_found
from router.openai.fields import INT64_MAX, INT64_MIN
from router.openai.messages import parse_messages
from router.openai.tools import NO_TOOLS, ToolChoice, ToolConfig, constraint, parse_tools
from router.validation import (
    INT32_MAX,
    MAX_STOP_BYTES,
    RequestLimits,
    check_params,
    check_text,
)
from router.validation import check_prompt_ids as check_ids

COMPLETION_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default for /v1/completions; chat completions default to the model's context."""
MAX_N = 128
"""Most choices (`n`, `best_of`) one request may ask for."""
MAX_BAD_WORDS = 256
"""Most bad_words one request may ban."""
MAX_BEAM_WIDTH = MAX_LOGPROBS // 2
"""Widest beam search: each step asks for 2 x width logprobs (as vLLM does)."""
MAX_PROMPTS = 256
"""Most prompts in one /v1/completions batch."""
_NO_PROMPT = "Either prompt or prompt_embeds must be provided and non-empty."  # vLLM's words

# Request fields that go straight into SamplingParams under the same name.
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
             "include_stop_str_in_output")
# Known fields whose values cannot be honoured here: refused when set to anything but these.
_REFUSED = {
    "logits_processors": ([],), "prompt_embeds": ([],), "suffix": ("",),
    "chat_template": ("",), "functions": ([],), "function_call": ("none",),
}
_REFUSED_WHY = {
    "functions": "functions are deprecated: send tools instead",
    "function_call": "function_call is deprecated: send tool_choice instead",
    "chat_template": "a chat template per request is not accepted; the server's (from the "
                     "model or --chat-template) is used",
    "prompt_embeds": "prompt embeddings are not supported",
}


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
    root: str = ""
    """The checkpoint the model was loaded from (/v1/models `root`)."""
    aliases: tuple[str, ...] = ()
    """Other names requests may use (vLLM's --served-model-name A B ...)."""
    max_logprobs: int = MAX_LOGPROBS
    """Most top logprobs a request may ask for (vLLM's --max-logprobs, at most the
    engine's MAX_LOGPROBS)."""

    @property
    def names(self) -> tuple[str, ...]:
        return (self.id, *self.aliases)

    @property
    def limits(self) -> RequestLimits:
        """The limits gRPC requests meet too (`router/validation.py`)."""
        return RequestLimits(self.max_model_len, self.vocab_size, self.max_token_bytes)


class IgnoredFields:
    """Logs each ignored field name once per server (not once per request)."""

    def __init__(self, log: logging.Logger) -> None:
        self._seen: set[str] = set()
        self._log = log

    def report(self, names: set[str], where: str) -> None:
        new = sorted(names - self._seen)
        if new:
            self._seen.update(new)
            self._log.warning("ignoring unsupported %s field(s): %s (logged once each)",
                              where, ", ".join(new))


@dataclass(frozen=True)
class StreamOptions:
    include_usage: bool = False
    """A last chunk with the request's usage."""
    continuous_usage_stats: bool = False
    """With include_usage: every chunk carries the usage so far (vLLM)."""


@dataclass(frozen=True)
class OutputOptions:
    """How both endpoints present their outputs."""

    n: int = 1
    stream: bool = False
    stream_options: StreamOptions = StreamOptions()
    return_token_ids: bool = False
    """Choices carry `token_ids` (and the prompt's `prompt_token_ids`)."""
    tokens_as_ids: bool = False
    """Logprob entries name tokens as "token_id:N" (return_tokens_as_token_ids)."""
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    """What the client asked for (vLLM's prompt_logprobs), shown as `prompt_logprobs`."""
    echo: bool = False
    request_id: str | None = None
    """The client's id (vLLM's request_id): the response id is built from it."""


@dataclass(frozen=True)
class BeamOptions:
    """vLLM's `use_beam_search` (run by `beam_search.py`)."""

    width: int
    """Beams kept each step, and choices returned (the request's `n`)."""
    length_penalty: float = 1.0
    """Scores divide by length ** length_penalty: above 1 favours longer outputs."""


@dataclass(frozen=True)
class Truncation:
    """vLLM's `truncate_prompt_tokens` (-1: the model's context) and `truncation_side`."""

    keep: int
    """Most prompt tokens kept."""
    left: bool = True
    """Drop tokens from the start (vLLM's default side), else from the end."""

    def apply(self, ids: list[int]) -> list[int]:
        if len(ids) <= self.keep:
            return ids
        return ids[len(ids) - self.keep:] if self.left else ids[:self.keep]


@dataclass(frozen=True)
class CompletionRequest:
    prompts: tuple[str | tuple[int, ...], ...]
    """One choice group per prompt: text, or token ids."""
    params: SamplingParams
    """As the workers run it (echo with max_tokens 0 still generates one token, dropped)."""
    out: OutputOptions
    logprobs: int | None = None
    """Top alternatives per token in the response (None: no logprobs)."""
    best_of: int = 1
    """Candidates per prompt; the `n` with the highest total logprob are returned."""
    add_special_tokens: bool = True
    truncation: Truncation | None = None
    """truncate_prompt_tokens / truncation_side: keep this many of the prompt's tokens."""
    generate: bool = True
    """False: echo with max_tokens 0, the prompt is scored and nothing is generated."""
    max_tokens_explicit: bool = False
    beam: BeamOptions | None = None
    """use_beam_search: the n choices are the n best beams (best_of is not used)."""
    bad_words: tuple[str, ...] = ()
    """vLLM's bad_words, tokenized by the handler into `params.bad_words_token_ids`."""


@dataclass(frozen=True)
class TemplateOptions:
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    """Add the tokenizer's BOS/EOS again when encoding the rendered template."""
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    """chat_template_kwargs: extra template variables."""


@dataclass(frozen=True)
class ChatRequest:
    messages: tuple[dict, ...]
    """Template-ready messages (content flattened to text)."""
    params: SamplingParams
    out: OutputOptions
    logprobs: bool = False
    """Chat-format logprobs (params.logprobs holds top_logprobs)."""
    tools: ToolChoice = NO_TOOLS
    template: TemplateOptions = TemplateOptions()
    max_tokens_explicit: bool = False
    truncation: Truncation | None = None
    beam: BeamOptions | None = None
    bad_words: tuple[str, ...] = ()


# -- endpoints -----------------------------------------------------------------------------------


def parse_completion(body: Any, model: ServedModel, ignored: IgnoredFields | None = None
                     ) -> CompletionRequest:
    fields = _fields(body, ignored, "completions", _COMPLETION_FIELDS)
    _check_model(fields, model)
    out = _output_options(fields, model.max_logprobs)
    logprobs = f.integer(fields, "logprobs", None, 0, model.max_logprobs)
    beam = _beam_options(fields, out)
    best_of = out.n if beam else f.integer(fields, "best_of", out.n, 1, MAX_N)
    if best_of < out.n:
        raise RequestError(f"best_of must be >= n ({out.n}), got {best_of}", "best_of")
    if best_of > out.n and out.stream:
        raise RequestError("best_of > n cannot be streamed", "best_of")
    max_tokens = fields.get("max_tokens", COMPLETION_DEFAULT_MAX_TOKENS)
    generate = not (out.echo and max_tokens == 0)
    if not generate:
        max_tokens = 1  # the prompt is computed anyway; its one token is dropped
    # echo shows the prompt's logprobs with the output's (the first prompt token has none).
    scored = logprobs if out.echo and logprobs is not None else None
    prompt_lp = _max_opt(out.prompt_logprobs, scored)
    internal_lp = logprobs if logprobs is not None or best_of == out.n else 0
    params = _sampling(fields, model, "max_tokens", max_tokens, internal_lp, prompt_lp)
    prompts = _prompts(fields.get("prompt"))
    for prompt in prompts:
        if isinstance(prompt, str):
            check_text(prompt, model.limits, "prompt")  # before anyone tokenises it
    return CompletionRequest(
        prompts, params, out, logprobs, best_of,
        f.boolean(fields, "add_special_tokens", True),
        truncation(fields, model), generate, "max_tokens" in fields,
        _checked_beam(beam, params, generate), _bad_words(fields))


def parse_chat(body: Any, model: ServedModel, tool_config: ToolConfig | None = None,
               ignored: IgnoredFields | None = None) -> ChatRequest:
    fields = _fields(body, ignored, "chat.completions", _CHAT_FIELDS)
    _check_model(fields, model)
    out = _output_options(fields, model.max_logprobs)
    messages, extra_keys = parse_messages(fields.get("messages"))
    # The contents bound the rendered prompt's tokens from below, as a text's bytes do.
    check_text("\n".join(_texts(messages)) or " ", model.limits, "messages")
    if ignored is not None and extra_keys:
        ignored.report(extra_keys, "chat message")
    want_lp, top = _chat_logprobs(fields, model.max_logprobs)
    tools = parse_tools(fields, tool_config or ToolConfig())
    template = template_options(fields)
    max_field = "max_completion_tokens" if "max_completion_tokens" in fields else "max_tokens"
    params = _sampling(fields, model, max_field, fields.get(max_field, model.max_model_len),
                       top if want_lp else None, out.prompt_logprobs)
    tool_spec = constraint(tools)
    if tool_spec is not None:
        if params.structured is not None:
            raise RequestError("tool_choice required / a named tool cannot be combined with "
                               "response_format or structured_outputs", "tool_choice")
        params = dataclasses.replace(params, structured=tool_spec)
    return ChatRequest(messages, params, out, want_lp, tools, template,
                       max_field in fields, truncation(fields, model),
                       _checked_beam(_beam_options(fields, out), params, True),
                       _bad_words(fields))


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


def check_prompt_ids(ids: list[int], model: ServedModel, param: str,
                     max_tokens: int | None = None) -> None:
    """Token ids the workers accept (`validation.check_prompt_ids`, as on gRPC), leaving
    room for `max_tokens` of output when the client set it. The length errors are in
    vLLM's words (clients match on "maximum context length")."""
    if len(ids) >= model.max_model_len:
        raise RequestError(f"This model's maximum context length is {model.max_model_len} "
                           f"tokens. However, your request has {len(ids)} input tokens. "
                           "Please reduce the length of the input messages.", param)
    check_ids(ids, model.limits, param)
    if max_tokens is not None and len(ids) + max_tokens > model.max_model_len:
        raise RequestError(f"This model's maximum context length is {model.max_model_len} "
                           f"tokens. However, you requested {len(ids) + max_tokens} tokens "
                           f"({len(ids)} in the {param}, {max_tokens} in the completion). "
                           "Please reduce the length of the prompt or completion.", param)


# -- fields --------------------------------------------------------------------------------------

_COMMON = frozenset({*_SAMPLING, "model", "max_tokens", "stream", "stream_options", "n",
                     "user", "logit_bias", "seed", "skip_special_tokens", "prompt_logprobs",
                     "return_token_ids", "return_tokens_as_token_ids", "request_id",
                     "response_format", "structured_outputs", *constraints.GUIDED_FIELDS,
                     "truncate_prompt_tokens", "truncation_side", *_REFUSED, "echo",
                     "use_beam_search", "length_penalty", "allowed_token_ids", "bad_words",
                     "priority"})
_COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs", "best_of", "add_special_tokens"}
_CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs",
                          "tools", "tool_choice", "parallel_tool_calls",
                          "add_generation_prompt", "continue_final_message",
                          "add_special_tokens", "chat_template_kwargs"}


def _fields(body: Any, ignored: IgnoredFields | None, where: str,
            known: frozenset[str]) -> dict[str, Any]:
    if not isinstance(body, Mapping):
        raise RequestError(f"the request body must be a JSON object, got "
                           f"{type(body).__name__}")
    fields = {k: v for k, v in body.items() if v is not None}
    unknown = {k for k in fields if k not in known}
    if unknown and ignored is not None:
        ignored.report(unknown, where)
    for name, allowed in _REFUSED.items():
        if name in fields and fields[name] not in allowed:
            raise RequestError(_REFUSED_WHY.get(name, f"{name} is not supported"), name)
    return {k: v for k, v in fields.items() if k not in unknown}


def _check_model(fields: dict[str, Any], model: ServedModel) -> None:
    name = fields.get("model", model.id)
    if not isinstance(name, str):
        raise RequestError("model must be a string", "model")
    if name not in model.names:
        raise model_not_found(name, model.id)
    if "user" in fields and not isinstance(fields["user"], str):
        raise RequestError("user must be a string", "user")


def _output_options(fields: dict[str, Any], max_logprobs: int = MAX_LOGPROBS
                    ) -> OutputOptions:
    stream = f.boolean(fields, "stream", False)
    if "stream_options" in fields and not stream:
        raise RequestError("Stream options can only be defined when `stream=True`.",
                           "stream_options")
    opts = f.mapping(fields, "stream_options") or {}
    for key in ("include_usage", "continuous_usage_stats"):
        if opts.get(key) is not None and not isinstance(opts[key], bool):
            raise RequestError(f"stream_options.{key} must be a boolean", "stream_options")
    request_id = f.string(fields, "request_id")
    priority = f.integer(fields, "priority", 0, INT64_MIN, INT64_MAX)
    if priority:  # vLLM's answer without --scheduling-policy priority (pdserve has none)
        raise RequestError(f"Got priority {priority} but Priority scheduling is not enabled.",
                           "priority")
    return OutputOptions(
        n=f.integer(fields, "n", 1, 1, MAX_N), stream=stream,
        stream_options=StreamOptions(bool(opts.get("include_usage")),
                                     bool(opts.get("continuous_usage_stats"))),
        return_token_ids=f.boolean(fields, "return_token_ids", False),
        tokens_as_ids=f.boolean(fields, "return_tokens_as_token_ids", False),
        skip_special_tokens=f.boolean(fields, "skip_special_tokens", True),
        prompt_logprobs=f.integer(fields, "prompt_logprobs", None, 0, max_logprobs),
        echo=f.boolean(fields, "echo", False), request_id=request_id or None)


def _sampling(fields: dict[str, Any], model: ServedModel, max_field: str, max_tokens: Any,
              logprobs: int | None, prompt_logprobs: int | None) -> SamplingParams:
    kwargs = {name: fields[name] for name in _SAMPLING if name in fields}
    if f.is_int(max_tokens) and max_tokens > model.max_model_len:  # vLLM's words
        raise RequestError(f"'max_tokens' or 'max_completion_tokens' is too large: "
                           f"{max_tokens}. This model's maximum context length is "
                           f"{model.max_model_len} tokens.", max_field)
    if "allowed_token_ids" in fields:
        kwargs["allowed_token_ids"] = _allowed_token_ids(fields["allowed_token_ids"])
    try:
        params = SamplingParams(
            max_tokens=max_tokens, logprobs=logprobs, seed=f.seed(fields),
            logit_bias=f.logit_bias(fields, model.vocab_size),
            prompt_logprobs=prompt_logprobs, structured=constraints.from_fields(fields),
            **kwargs)
        params.validate_for_model(model.vocab_size)
    except RequestError:
        raise
    except ValueError as exc:  # SamplingParams' messages start with the field's name
        first = str(exc).split(" ", 1)[0]
        param = max_field if first == "max_tokens" else first if first in fields else None
        raise RequestError(str(exc), param) from None
    check_params(params, model.limits, max_field)  # the limits gRPC requests meet too
    return params


def _texts(messages: list[dict]) -> list[str]:
    """The free text of template-ready messages: contents and tool-call arguments."""
    out = [m["content"] for m in messages if isinstance(m.get("content"), str)]
    for m in messages:
        for call in m.get("tool_calls") or ():
            args = (call.get("function") or {}).get("arguments")
            if isinstance(args, str):
                out.append(args)
    return out


def _chat_logprobs(fields: dict[str, Any], max_logprobs: int) -> tuple[bool, int]:
    want = f.boolean(fields, "logprobs", False)
    top = f.integer(fields, "top_logprobs", 0, 0, max_logprobs)
    if top and not want:
        raise RequestError("top_logprobs needs logprobs set to true", "top_logprobs")
    return want, top


def template_options(fields: dict[str, Any]) -> TemplateOptions:
    gen = f.boolean(fields, "add_generation_prompt", True)
    cont = f.boolean(fields, "continue_final_message", False)
    if gen and cont:
        raise RequestError("continue_final_message and add_generation_prompt cannot both "
                           "be true", "continue_final_message")
    kwargs = f.mapping(fields, "chat_template_kwargs") or {}
    return TemplateOptions(gen, cont, f.boolean(fields, "add_special_tokens", False),
                           dict(kwargs))


def _prompts(prompt: Any) -> tuple[str | tuple[int, ...], ...]:
    """A string, token ids, or a batch: a list of strings or of token-id lists."""
    if prompt is None or prompt == [] or prompt == "":
        raise RequestError(_NO_PROMPT, "prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                   and all(f.is_int(t) for t in prompt)):
        items = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        items = prompt
    else:
        raise RequestError("prompt must be a string, a list of token ids, or a non-empty "
                           "list of either", "prompt")
    if len(items) > MAX_PROMPTS:
        raise RequestError(f"at most {MAX_PROMPTS} prompts per request", "prompt")
    out: list[str | tuple[int, ...]] = []
    for p in items:
        if isinstance(p, str):
            if not p:
                raise RequestError(_NO_PROMPT, "prompt")
            out.append(p)
        elif p and all(f.is_int(t) for t in p):
            out.append(tuple(p))
        else:
            raise RequestError("each prompt must be a non-empty string or list of token ids",
                               "prompt")
    return tuple(out)


def _allowed_token_ids(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(f.is_int(t) for t in value):
        raise RequestError("allowed_token_ids must be a list of token ids",
                           "allowed_token_ids")
    if not value:
        raise RequestError("allowed_token_ids must not be empty", "allowed_token_ids")
    return tuple(value)


def _bad_words(fields: dict[str, Any]) -> tuple[str, ...]:
    words = fields.get("bad_words", [])
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        raise RequestError("bad_words must be a list of strings", "bad_words")
    if len(words) > MAX_BAD_WORDS or any(len(w) > MAX_STOP_BYTES for w in words):
        raise RequestError(f"bad_words takes at most {MAX_BAD_WORDS} words of at most "
                           f"{MAX_STOP_BYTES} characters", "bad_words")
    return tuple(w for w in words if w.strip())


def _beam_options(fields: dict[str, Any], out: OutputOptions) -> BeamOptions | None:
    if not f.boolean(fields, "use_beam_search", False):
        return None
    if out.n > MAX_BEAM_WIDTH:
        raise RequestError(f"use_beam_search takes n <= {MAX_BEAM_WIDTH} (the beam width), "
                           f"got {out.n}", "n")
    penalty = f.number(fields, "length_penalty")
    return BeamOptions(out.n, 1.0 if penalty is None else penalty)


def _checked_beam(beam: BeamOptions | None, params: SamplingParams, generate: bool
                  ) -> BeamOptions | None:
    if beam is None:
        return None
    if params.structured is not None:
        raise RequestError("use_beam_search cannot be combined with structured outputs or "
                           "a required / named tool call", "use_beam_search")
    if not generate:
        raise RequestError("use_beam_search needs max_tokens >= 1", "max_tokens")
    return beam


def truncation(fields: dict[str, Any], model: ServedModel) -> Truncation | None:
    keep = f.integer(fields, "truncate_prompt_tokens", None, -1, INT32_MAX)
    side = fields.get("truncation_side", "left")
    if side not in ("left", "right"):
        raise RequestError("truncation_side must be 'left' or 'right'", "truncation_side")
    if keep is None:
        return None
    if keep == 0:
        raise RequestError("truncate_prompt_tokens must be -1 (the model's context) or >= 1",
                           "truncate_prompt_tokens")
    return Truncation(model.max_model_len if keep == -1 else keep, side == "left")


def _max_opt(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"duplicate key {dup!r}")
    return out
