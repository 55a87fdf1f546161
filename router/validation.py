"""What a public request may be: one set of limits and checks for gRPC and HTTP alike.

Owns `RequestLimits` (derived from the served model), the checks both public APIs run on a
request's fields, and the gRPC `GenerateRequest` → `ValidRequest` path. Every failure is a
`RequestError` naming the field (gRPC INVALID_ARGUMENT, HTTP 400). Nothing here tokenises:
`check_text` bounds text by bytes *before* it is tokenised (off the loop, `router/tokenize.py`).

The text bound. A text of B bytes has at least B / L tokens, L being the byte length of the
longest token in the vocabulary (`Tokenizer.max_token_bytes`): every token spells at most L
bytes of the text back. So a text over `max_model_len × L` bytes cannot fit the context, and
is refused without tokenising it; no text that could fit is ever refused (for tokenizers
whose tokens spell the text back: byte-level BPE, SentencePiece; a normalizer that deletes
characters could make a refused text fit). L is at least 4 (one UTF-8 character). The gRPC
message limit and the HTTP body limit derive from the same bound, with room for each
encoding's overhead, so a transport refuses only what validation would refuse anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto import pb
from pdserve.serving.convert import params_from_pb

MAX_REQUEST_ID = 256
MAX_STOP_STRINGS = 16
MAX_STOP_BYTES = 1024
"""Per stop string: the text stream holds back this much output while it might still match."""
MAX_STOP_TOKEN_IDS = 1024
INT32_MAX = 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38
ENVELOPE_BYTES = 64 * 1024
"""Room for everything in a request but its prompt (ids, sampling, stop strings)."""
_JSON_BYTES_PER_TEXT_BYTE = 6  # the worst case: a control character escaped as \\u00XX
_JSON_BYTES_PER_TOKEN_ID = 12  # "4294967295, "
_PB_BYTES_PER_TOKEN_ID = 5  # a varint uint32
_ID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._:-")


class RequestError(ValueError):
    """A request field is missing, of the wrong type or out of range (INVALID_ARGUMENT / 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class RequestLimits:
    max_model_len: int
    """Prompt + completion tokens the workers accept."""
    vocab_size: int
    max_token_bytes: int = 4
    """Bytes of the longest token's text (at least 4)."""

    @property
    def max_prompt_bytes(self) -> int:
        """Longest prompt text (UTF-8 bytes) that could fit the context."""
        return self.max_model_len * max(self.max_token_bytes, 4)

    @property
    def max_message_bytes(self) -> int:
        """The public gRPC server's receive limit."""
        ids = self.max_model_len * _PB_BYTES_PER_TOKEN_ID
        return max(self.max_prompt_bytes, ids) + self._stops() + ENVELOPE_BYTES

    @property
    def max_body_bytes(self) -> int:
        """The HTTP server's request body limit (JSON escapes text at worst 6×)."""
        text = self.max_prompt_bytes * _JSON_BYTES_PER_TEXT_BYTE
        ids = self.max_model_len * _JSON_BYTES_PER_TOKEN_ID
        return max(text, ids) + _JSON_BYTES_PER_TEXT_BYTE * self._stops() + ENVELOPE_BYTES

    def _stops(self) -> int:
        return MAX_STOP_STRINGS * MAX_STOP_BYTES


@dataclass(frozen=True)
class ValidRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    skip_special_tokens: bool = True
    """Leave special tokens (EOS, chat markers) out of the output text."""


@dataclass(frozen=True)
class GenerateInput:
    """A checked gRPC request whose prompt may still need tokenising (`text` set)."""

    request_id: str
    text: str | None
    token_ids: list[int] | None
    params: SamplingParams


def check_text(text: str, limits: RequestLimits, param: str) -> None:
    """Refuse empty text, text that is not Unicode, and text too long to fit the context,
    before tokenising it."""
    if not text:
        raise RequestError(f"{param} must not be empty", param)
    # A character is at least one byte: far too long is known without encoding.
    size = len(text) if len(text) > limits.max_prompt_bytes else _utf8_len(text, param)
    if size > limits.max_prompt_bytes:
        raise RequestError(
            f"{param} is longer than {limits.max_prompt_bytes} bytes: more tokens than the "
            f"model's context ({limits.max_model_len}) can hold", param)


def _utf8_len(text: str, param: str) -> int:
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate (JSON "\\ud800")
        raise RequestError(f"{param} is not valid Unicode", param) from None


def check_chat(chat: pb.ChatPrompt, limits: RequestLimits) -> None:
    """Refuse a conversation too long to fit the context before its template renders it:
    its texts (contents, tool definitions and calls) are bounded by bytes as a text prompt
    is, and each message renders to at least one token."""
    if len(chat.messages) >= limits.max_model_len:
        raise RequestError(f"chat has {len(chat.messages)} messages; the model's context is "
                           f"{limits.max_model_len} tokens", "messages")
    texts = [m.content for m in chat.messages]
    texts += [c.arguments_json for m in chat.messages for c in m.tool_calls]
    texts += [t.description + t.parameters_json for t in chat.tools]
    texts.append(chat.chat_template_kwargs_json)
    size = sum(_utf8_len(t, "messages") for t in texts)
    if size > limits.max_prompt_bytes:
        raise RequestError(
            f"chat is longer than {limits.max_prompt_bytes} bytes: more tokens than the "
            f"model's context ({limits.max_model_len}) can hold", "messages")


def check_prompt_ids(ids: list[int], limits: RequestLimits, param: str) -> None:
    """Token ids the workers accept: non-empty, in the vocabulary, leaving room for output."""
    if not ids:
        raise RequestError(f"{param} must not be empty", param)
    if len(ids) >= limits.max_model_len:
        raise RequestError(f"{param} has {len(ids)} tokens; the model's context is "
                           f"{limits.max_model_len} tokens", param)
    bad = [t for t in ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise RequestError(f"{param} contains token ids out of vocabulary (outside "
                           f"[0, {limits.vocab_size})): {bad[:5]}", param)


def check_params(p: SamplingParams, limits: RequestLimits, max_field: str = "max_tokens"
                 ) -> None:
    """What SamplingParams accepts but this deployment does not."""
    if p.max_tokens > limits.max_model_len:
        raise RequestError(f"{max_field} must be <= the model's context "
                           f"({limits.max_model_len}), got {p.max_tokens}", max_field)
    if len(p.stop) > MAX_STOP_STRINGS:
        raise RequestError(f"stop takes at most {MAX_STOP_STRINGS} strings", "stop")
    if any(_utf8_len(s, "stop") > MAX_STOP_BYTES for s in p.stop):
        raise RequestError(f"stop strings must be at most {MAX_STOP_BYTES} bytes", "stop")
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise RequestError(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids",
                           "stop_token_ids")
    # Values SamplingParams accepts but the int32/float32 fields of the worker RPCs cannot.
    if p.top_k > INT32_MAX:
        raise RequestError(f"top_k must be <= {INT32_MAX}, got {p.top_k}", "top_k")
    for name in ("temperature", "repetition_penalty"):
        if getattr(p, name) > FLOAT32_MAX:
            raise RequestError(f"{name} must be <= {FLOAT32_MAX:g}", name)
    try:
        p.validate_for_model(limits.vocab_size)
    except ValueError as exc:
        raise RequestError(str(exc), "stop_token_ids") from None


def check_request_id(rid: str) -> None:
    if len(rid) > MAX_REQUEST_ID:
        raise RequestError(f"request_id is longer than {MAX_REQUEST_ID} characters",
                           "request_id")
    if not set(rid) <= _ID_CHARS:
        raise RequestError("request_id may only contain letters, digits and . _ : -",
                           "request_id")


def check_generate(req: pb.GenerateRequest, limits: RequestLimits, model_id: str
                   ) -> GenerateInput:
    """Every check of a gRPC request that needs no tokenizer."""
    check_request_id(req.request_id)
    if req.model and req.model != model_id:
        raise RequestError(f"model {req.model!r} is not served here (serving {model_id!r})",
                           "model")
    try:
        params = params_from_pb(req.sampling)
    except ValueError as exc:  # SamplingParams' messages start with the field's name
        raise RequestError(str(exc), str(exc).split(" ", 1)[0]) from None
    check_params(params, limits)
    which = req.WhichOneof("prompt")
    if which == "text":
        check_text(req.text, limits, "prompt text")
        return GenerateInput(req.request_id, req.text, None, params)
    if which == "token_ids":
        ids = list(req.token_ids.ids)
        check_prompt_ids(ids, limits, "prompt token_ids")
        return GenerateInput(req.request_id, None, ids, params)
    raise RequestError("prompt must be set (text or token_ids)", "prompt")


def complete(inp: GenerateInput, ids: list[int], limits: RequestLimits) -> ValidRequest:
    """The request once its text is tokenised (`ids`; the given token ids otherwise)."""
    check_prompt_ids(ids, limits, "prompt text" if inp.text is not None else "prompt token_ids")
    return ValidRequest(inp.request_id, ids, inp.params)
