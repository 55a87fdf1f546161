"""Tool calling: the request's `tools` and `tool_choice`, the constraint they imply, and the
calls found in the output (whole, or as OpenAI's streamed `tool_calls` deltas).

    tool_choice   output                                     parsed by
    none          free text (tools still shown to the model)  -
    auto          free text, maybe calls in the model's       --tool-call-parser (hermes,
                  own format                                  llama3_json); needs
                                                              --enable-auto-tool-choice
    required      JSON array of {"name", "parameters"}, one   RequiredParser
                  of the tools' schemas per element
    {"function": {"name": N}}  the JSON arguments of N        NamedParser
"""

from __future__ import annotations

import enum
import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.structured.spec import StructuredOutput
from router.openai.constraints import json_schema
from router.openai.errors import RequestError
from router.openai.tool_parsers import (
    Call,
    NamedParser,
    RequiredParser,
    ToolParser,
    normalised_arguments,
    parser_for,
)


class ToolMode(enum.Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True)
class ToolConfig:
    """The server's `--tool-call-parser` / `--enable-auto-tool-choice`."""

    parser: str | None = None
    auto: bool = False


@dataclass(frozen=True)
class ToolChoice:
    mode: ToolMode
    name: str = ""
    """NAMED: the tool to call."""
    definitions: tuple[Mapping[str, Any], ...] = ()
    """The request's tools as OpenAI function definitions, for the chat template."""
    parallel: bool = True
    """REQUIRED: more than one call allowed (`parallel_tool_calls`)."""

    @property
    def calls_expected(self) -> bool:
        return self.mode is not ToolMode.NONE


NO_TOOLS = ToolChoice(ToolMode.NONE)


def parse_tools(fields: Mapping[str, Any], config: ToolConfig) -> ToolChoice:
    """`tools`, `tool_choice`, `parallel_tool_calls` as vLLM reads them."""
    tools = tool_definitions(fields.get("tools"))
    choice = fields.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    parallel = fields.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise RequestError("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if choice == "none":
        return ToolChoice(ToolMode.NONE, definitions=tools)
    if not tools:
        raise RequestError("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice == "auto":
        if not (config.auto and config.parser):
            raise RequestError('"auto" tool choice requires --enable-auto-tool-choice and '
                               "--tool-call-parser to be set", "tool_choice")
        return ToolChoice(ToolMode.AUTO, definitions=tools)
    if choice == "required":
        return ToolChoice(ToolMode.REQUIRED, definitions=tools, parallel=parallel)
    name = _named(choice)
    if name not in {t["function"]["name"] for t in tools}:
        raise RequestError(f"Tool '{name}' has not been passed in `tools`.", "tool_choice")
    return ToolChoice(ToolMode.NAMED, name, tools)


def constraint(choice: ToolChoice) -> StructuredOutput | None:
    """The JSON schema a required or named call is generated under (None otherwise)."""
    funcs = {t["function"]["name"]: t["function"] for t in choice.definitions}
    if choice.mode is ToolMode.NAMED:
        return json_schema(_parameters(funcs[choice.name]), "tools")
    if choice.mode is not ToolMode.REQUIRED:
        return None
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {
        "type": "object",
        "anyOf": [{"properties": {"name": {"type": "string", "enum": [name]},
                                  "parameters": _parameters(f)},
                   "required": ["name", "parameters"]} for name, f in funcs.items()]}}
    if not choice.parallel:
        schema["maxItems"] = 1
    defs = {k: v for f in funcs.values() for k, v in _parameters(f).get("$defs", {}).items()}
    if defs:
        schema["$defs"] = defs
    return json_schema(schema, "tools")


def output_parser(choice: ToolChoice, config: ToolConfig) -> ToolParser | None:
    if choice.mode is ToolMode.NAMED:
        return NamedParser(choice.name)
    if choice.mode is ToolMode.REQUIRED:
        return RequiredParser()
    if choice.mode is ToolMode.AUTO and config.parser:
        return parser_for(config.parser)
    return None


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_json(call: Call, call_id_: str) -> dict:
    return {"id": call_id_, "type": "function",
            "function": {"name": call.name or "", "arguments": normalised_arguments(call)}}


@dataclass
class ToolCallStream:
    """Turns one choice's growing output into OpenAI deltas: content, then `tool_calls`
    entries (`index`, `id`, `type` and `function.name` first; `function.arguments` pieces
    after)."""

    parser: ToolParser
    text: str = ""
    _content_sent: int = 0
    _names_sent: int = 0
    _args_sent: list[int] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)

    def feed(self, delta: str, final: bool) -> tuple[str, list[dict]]:
        """(content delta, tool_calls deltas) after `delta` more text."""
        self.text += delta
        parsed = self.parser.parse(self.text, final)
        content = parsed.content[self._content_sent:]
        self._content_sent = max(self._content_sent, len(parsed.content))
        out: list[dict] = []
        for i, call in enumerate(parsed.calls):
            if i >= len(self.ids):
                if call.name is None:
                    break  # later calls cannot be announced before this one
                self.ids.append(call_id())
                self._args_sent.append(0)
                out.append({"index": i, "id": self.ids[i], "type": "function",
                            "function": {"name": call.name, "arguments": ""}})
            piece = call.arguments[self._args_sent[i]:]
            if piece:
                self._args_sent[i] = len(call.arguments)
                if out and out[-1]["index"] == i:
                    out[-1]["function"]["arguments"] += piece
                else:
                    out.append({"index": i, "function": {"arguments": piece}})
        return content, out

    @property
    def called(self) -> bool:
        return bool(self.ids)


def tool_definitions(tools: Any) -> tuple[Mapping[str, Any], ...]:
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise RequestError("tools must be a list", "tools")
    out = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, Mapping) else None
        if not isinstance(t, Mapping) or t.get("type", "function") != "function" or \
                not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or \
                not fn["name"]:
            raise RequestError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                               "{\"name\": ..., \"parameters\": {...}}}", "tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, Mapping):
            raise RequestError(f"tools[{i}].function.parameters must be a JSON Schema object",
                               "tools")
        out.append({"type": "function", "function": dict(fn)})
    return tuple(out)


def _named(choice: Any) -> str:
    fn = choice.get("function") if isinstance(choice, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise RequestError('tool_choice must be "none", "auto", "required" or {"type": '
                           '"function", "function": {"name": ...}}', "tool_choice")
    return fn["name"]


def _parameters(fn: Mapping[str, Any]) -> dict[str, Any]:
    params = fn.get("parameters")
    return dict(params) if params else {"type": "object", "properties": {}}


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict]:
    """Messages as chat templates expect them: a tool call's `arguments` as an object (the
    OpenAI wire carries a JSON string), as transformers and vLLM pass them."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [_with_object_arguments(c) for c in m["tool_calls"]]
        out.append(m)
    return out


def _with_object_arguments(call: Mapping[str, Any]) -> dict:
    call = dict(call)
    fn = dict(call.get("function") or {})
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except ValueError:
            pass  # templates that want the text get it as sent
    call["function"] = fn
    return call
