"""Tool calls in a model's output text, complete or still being generated.

Every parser maps the whole output so far to a `Parsed`: the content (text that is not a
call, minus anything that may still turn out to open one) and the calls, each with its name
(once its string is complete) and the raw JSON text of its arguments so far. The raw text
only grows as the output grows, so streaming sends its increments and their concatenation
is exactly the final arguments' JSON.

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call> ... (Qwen2.5, SmolLM2,
                 Hermes): text before the first tag is content
    llama3_json  {"name": ..., "parameters": {...}}; {...}  (Llama 3.x JSON tool calling),
                 optionally after <|python_tag|>; any other output is content
    required     [{"name": ..., "parameters": {...}}, ...]  the output of tool_choice
                 "required", constrained to this shape by its JSON schema
    named        {...}  the arguments of the one tool tool_choice names
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

PARSERS = ("hermes", "llama3_json")
"""Names `--tool-call-parser` accepts."""


@dataclass(frozen=True)
class Call:
    name: str | None
    """None until the name's string is complete."""
    arguments: str
    """Raw JSON text of the arguments so far ("" before they start)."""
    complete: bool = False


@dataclass(frozen=True)
class Parsed:
    content: str
    calls: list[Call] = field(default_factory=list)


class ToolParser(ABC):
    @abstractmethod
    def parse(self, text: str, final: bool) -> Parsed:
        """Content and calls of the output so far (`final`: nothing more will come)."""


def parser_for(name: str) -> ToolParser:
    if name == "hermes":
        return HermesParser()
    if name == "llama3_json":
        return Llama3JsonParser()
    raise ValueError(f"unknown tool-call parser {name!r}; one of {', '.join(PARSERS)}")


class HermesParser(ToolParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool) -> Parsed:
        start = text.find(self.OPEN)
        if start < 0:
            keep = len(text) if final else len(text) - _tag_prefix(text, self.OPEN)
            return Parsed(text[:keep])
        calls = []
        while start >= 0:
            body_at = start + len(self.OPEN)
            end = text.find(self.CLOSE, body_at)
            body = text[body_at:] if end < 0 else text[body_at:end]
            call = _object_call(body.strip(), ("arguments", "parameters"))
            if call is not None:
                calls.append(call)
            start = -1 if end < 0 else text.find(self.OPEN, end + len(self.CLOSE))
        return Parsed(text[:text.find(self.OPEN)], calls)


class Llama3JsonParser(ToolParser):
    TAG = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> Parsed:
        body = text.lstrip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG):].lstrip()
        elif not final and self.TAG.startswith(body):
            return Parsed("")  # may still become the tag
        if not body.startswith("{"):
            return Parsed(text if body or final else "")
        calls = [c for part in _top_level_values(body, ";")
                 if (c := _object_call(part, ("parameters", "arguments"))) is not None]
        return Parsed("", calls)


class RequiredParser(ToolParser):
    """[{"name": ..., "parameters": {...}}, ...] (tool_choice "required")."""

    def parse(self, text: str, final: bool) -> Parsed:
        body = text.strip()
        if not body.startswith("["):
            return Parsed("")
        items = _top_level_values(body[1:], ",", closer="]")
        return Parsed("", [c for item in items
                           if (c := _object_call(item, ("parameters",))) is not None])


class NamedParser(ToolParser):
    """The whole output is the arguments of one tool (tool_choice names it)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def parse(self, text: str, final: bool) -> Parsed:
        args = text.strip()
        return Parsed("", [Call(self.name, args, final and _is_object(args))])


def normalised_arguments(call: Call) -> str:
    """Complete arguments re-serialised as compact JSON (non-streaming responses); the raw
    text when it is not valid JSON (a model's output cut short by max_tokens)."""
    try:
        return json.dumps(json.loads(call.arguments or "{}"), ensure_ascii=False)
    except ValueError:
        return call.arguments


# -- a scanner for JSON that may be cut off anywhere ------------------------------------------


def _object_call(text: str, arg_keys: tuple[str, ...]) -> Call | None:
    """A call from (possibly partial) `{"name": "...", "<arg key>": {...}}` text."""
    if not text.startswith("{"):
        return None
    spans, complete = _object_fields(text)
    name = None
    if "name" in spans:
        start, end = spans["name"]
        if end is not None:
            try:
                value = json.loads(text[start:end])
            except ValueError:
                value = None
            name = value if isinstance(value, str) else None
    args = ""
    for key in arg_keys:
        if key in spans:
            start, end = spans[key]
            args = text[start:end].rstrip() if end is not None else text[start:].rstrip()
            break
    return Call(name, args, complete)


def _object_fields(text: str) -> tuple[dict[str, tuple[int, int | None]], bool]:
    """Top-level keys of a JSON object text -> (value start, value end or None if the value
    is not complete yet); and whether the object itself is complete."""
    spans: dict[str, tuple[int, int | None]] = {}
    depth = 0
    i, n = 0, len(text)
    key: str | None = None
    value_start: int | None = None
    while i < n:
        ch = text[i]
        if ch == '"':
            end = _string_end(text, i)
            if depth == 1 and value_start is None:
                if end is None:
                    break
                j = _skip_space(text, end)
                if j < n and text[j] == ":":
                    key = _loads(text[i:end])
                    value_start = _skip_space(text, j + 1)
                    if value_start < n:
                        spans[key] = (value_start, None)
                    i = value_start
                    continue
            if end is None:
                break
            i = end
            if depth == 1 and value_start is not None and i > value_start and key is not None:
                if text[value_start] == '"':
                    spans[key] = (value_start, i)
                    value_start = key = None
            continue
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 1 and value_start is not None and key is not None:
                spans[key] = (value_start, i + 1)
                value_start = key = None
            if depth == 0:
                _close_scalar(text, spans, key, value_start, i)
                return spans, True
        elif ch == "," and depth == 1:
            _close_scalar(text, spans, key, value_start, i)
            value_start = key = None
        i += 1
    return spans, False


def _close_scalar(text, spans, key, value_start, i) -> None:
    if key is not None and value_start is not None and text[value_start] not in '{["':
        spans[key] = (value_start, i)


def _top_level_values(text: str, sep: str, closer: str | None = None) -> list[str]:
    """Split text into its depth-0 values separated by `sep` (the last may be partial);
    stops at `closer` at depth 0."""
    out: list[str] = []
    depth, start, i = 0, 0, 0
    while i < len(text):
        ch = text[i]
        if ch == '"':
            end = _string_end(text, i)
            if end is None:
                break
            i = end
            continue
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            if depth == 0 and ch == closer:
                break
            depth -= 1
        elif ch == sep and depth == 0:
            out.append(text[start:i].strip())
            start = i + 1
        i += 1
    last = text[start:i].strip()
    if last:
        out.append(last)
    return out


def _string_end(text: str, i: int) -> int | None:
    """Index just past the JSON string starting at text[i] == '"'; None if unterminated."""
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == '"':
            return j + 1
        j += 1
    return None


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _loads(s: str) -> str:
    try:
        return json.loads(s)
    except ValueError:
        return s


def _tag_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
