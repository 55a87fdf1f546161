"""Chat `messages` -> the dicts a chat template renders. Pure.

Tolerant where vLLM is: any role (the template decides what it accepts), extra keys on a
message ignored (reported to the caller, which logs them once); content as a string or a
list of text parts. Strict where it matters: a non-text part (image, audio) is refused, since
no model served here reads one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from router.openai.errors import RequestError

# Keys a message may carry that reach the template; anything else is ignored.
_MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id",
                           "reasoning_content", "reasoning", "refusal"})
_TEXT_PARTS = frozenset({"text", "input_text", "output_text"})


def parse_messages(messages: Any) -> tuple[tuple[dict, ...], set[str]]:
    """(template-ready messages, names of the ignored per-message keys)."""
    if messages is None:
        raise RequestError("messages is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", "messages")
    ignored: set[str] = set()
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise RequestError(f"{where} must be an object", "messages")
        ignored.update(k for k in m if k not in _MESSAGE_KEYS)
        out.append(_message(where, m))
    return tuple(out), ignored


def _message(where: str, m: Mapping[str, Any]) -> dict:
    role = m.get("role")
    if not isinstance(role, str) or not role:
        raise RequestError(f"{where}.role must be a non-empty string", "messages")
    out: dict[str, Any] = {"role": role, "content": _content(where, m.get("content"))}
    for key in ("name", "tool_call_id", "reasoning_content", "reasoning"):
        if m.get(key) is not None:
            if not isinstance(m[key], str):
                raise RequestError(f"{where}.{key} must be a string", "messages")
            out[key] = m[key]
    if m.get("tool_calls") is not None:
        out["tool_calls"] = _tool_calls(where, m["tool_calls"])
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
        if isinstance(part, str):
            texts.append(part)
            continue
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            raise RequestError(f"{where}.content[{j}]: only text parts are supported "
                               f"(got type {kind!r}); this model reads no images or audio",
                               "messages")
    return "\n".join(texts)


def _tool_calls(where: str, calls: Any) -> list[dict]:
    if not isinstance(calls, list):
        raise RequestError(f"{where}.tool_calls must be a list", "messages")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise RequestError(f"{where}.tool_calls[{j}] must be {{\"id\", \"type\": "
                               "\"function\", \"function\": {\"name\", \"arguments\"}}",
                               "messages")
        args = fn.get("arguments", "{}")
        if not isinstance(args, str | Mapping):
            raise RequestError(f"{where}.tool_calls[{j}].function.arguments must be a JSON "
                               "string", "messages")
        out.append({"id": str(c.get("id", "")), "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out
