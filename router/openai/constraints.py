"""Structured-output fields of a request -> one `StructuredOutput` (or None).

Three spellings, at most one per request:
- OpenAI's `response_format`: `{"type": "text" | "json_object" | "json_schema",
  "json_schema": {"name", "schema", "strict"}}` (and vLLM's `structural_tag`);
- vLLM's `structured_outputs`: `{"json" | "regex" | "choice" | "grammar" | "json_object" |
  "structural_tag": ...}`;
- vLLM's older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`.

`check` builds the grammar (tokenizer-independent) so an invalid schema, regex or grammar is
a 400 that says why, before any worker sees the request; it runs on a thread, cached.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Mapping
from typing import Any

from pdserve.engine.structured.grammar import InvalidConstraint, build_grammar
from pdserve.engine.structured.spec import ConstraintKind, StructuredOutput
from router.openai.errors import RequestError

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
# structured_outputs key -> kind
_KEYS = {"json": ConstraintKind.JSON_SCHEMA, "regex": ConstraintKind.REGEX,
         "choice": ConstraintKind.CHOICE, "grammar": ConstraintKind.GRAMMAR,
         "json_object": ConstraintKind.JSON_OBJECT,
         "structural_tag": ConstraintKind.STRUCTURAL_TAG}
# Options of structured_outputs that change nothing here (backend choice, whitespace pattern).
_OPTIONS = {"backend", "disable_fallback", "disable_any_whitespace",
            "disable_additional_properties", "whitespace_pattern", "_backend",
            "_backend_was_auto"}


def from_fields(fields: Mapping[str, Any]) -> StructuredOutput | None:
    """The request's constraint, from whichever spelling it used; RequestError if malformed
    or if it uses more than one."""
    found = []
    fmt = fields.get("response_format")
    if fmt is not None:
        spec = _response_format(fmt)
        if spec is not None:
            found.append(("response_format", spec))
    if fields.get("structured_outputs") is not None:
        found.append(("structured_outputs", _structured_outputs(fields["structured_outputs"])))
    guided = [name for name in GUIDED_FIELDS if fields.get(name) is not None]
    for name in guided:
        found.append((name, _guided(name, fields[name])))
    if len(found) > 1:
        raise RequestError(f"give one output constraint, not {', '.join(n for n, _ in found)}",
                           found[1][0])
    return found[0][1] if found else None


async def check(spec: StructuredOutput) -> None:
    """Raise RequestError (param `structured_outputs`) when the grammar cannot be built."""
    try:
        await asyncio.to_thread(_checked, spec)
    except InvalidConstraint as exc:
        raise RequestError(str(exc), "response_format") from None


@functools.lru_cache(maxsize=256)
def _checked(spec: StructuredOutput) -> bool:
    build_grammar(spec)  # raises InvalidConstraint (not cached: lru_cache keeps only returns)
    return True


def json_schema(schema: Any, param: str) -> StructuredOutput:
    """A JSON_SCHEMA constraint from a schema given as an object or as JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise RequestError(f"{param} is not valid JSON", param) from None
    if not isinstance(schema, Mapping | bool):
        raise RequestError(f"{param} must be a JSON Schema object", param)
    return _spec(ConstraintKind.JSON_SCHEMA, json.dumps(schema), param)


def _response_format(fmt: Any) -> StructuredOutput | None:
    param = "response_format"
    if not isinstance(fmt, Mapping) or not isinstance(fmt.get("type"), str):
        raise RequestError('response_format must be an object with a "type"', param)
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(ConstraintKind.JSON_OBJECT)
    if kind == "json_schema":
        js = fmt.get("json_schema")
        if not isinstance(js, Mapping):
            raise RequestError("response_format.json_schema must be an object with a schema",
                               param)
        schema = js.get("schema", js.get("json_schema"))
        if schema is None:
            return StructuredOutput(ConstraintKind.JSON_OBJECT)
        return json_schema(schema, "response_format.json_schema.schema")
    if kind == "structural_tag":
        return _spec(ConstraintKind.STRUCTURAL_TAG, json.dumps(dict(fmt)), param)
    raise RequestError(f"response_format.type must be text, json_object, json_schema or "
                       f"structural_tag, got {kind!r}", param)


def _structured_outputs(so: Any) -> StructuredOutput:
    param = "structured_outputs"
    if not isinstance(so, Mapping):
        raise RequestError("structured_outputs must be an object", param)
    keys = [k for k in _KEYS if so.get(k) not in (None, False)]
    unknown = sorted(set(so) - set(_KEYS) - _OPTIONS)
    if unknown:
        raise RequestError(f"structured_outputs has unknown key(s): {', '.join(unknown)}", param)
    if len(keys) != 1:
        raise RequestError("structured_outputs must set exactly one of "
                           f"{', '.join(_KEYS)}", param)
    key = keys[0]
    value = so[key]
    if key == "json":
        return json_schema(value, "structured_outputs.json")
    if key == "json_object":
        return StructuredOutput(ConstraintKind.JSON_OBJECT)
    if key == "choice":
        return _choice(value, "structured_outputs.choice")
    if key == "structural_tag":
        text = value if isinstance(value, str) else json.dumps(value)
        return _spec(ConstraintKind.STRUCTURAL_TAG, text, "structured_outputs.structural_tag")
    if not isinstance(value, str):
        raise RequestError(f"structured_outputs.{key} must be a string", param)
    return _spec(_KEYS[key], value, f"structured_outputs.{key}")


def _guided(name: str, value: Any) -> StructuredOutput:
    if name == "guided_json":
        return json_schema(value, name)
    if name == "guided_choice":
        return _choice(value, name)
    if not isinstance(value, str):
        raise RequestError(f"{name} must be a string", name)
    kind = ConstraintKind.REGEX if name == "guided_regex" else ConstraintKind.GRAMMAR
    return _spec(kind, value, name)


def _choice(value: Any, param: str) -> StructuredOutput:
    if not isinstance(value, list) or not value or not all(
            isinstance(c, str) and c for c in value):
        raise RequestError(f"{param} must be a non-empty list of non-empty strings", param)
    return StructuredOutput(ConstraintKind.CHOICE, choices=tuple(value))


def _spec(kind: ConstraintKind, text: str, param: str) -> StructuredOutput:
    try:
        return StructuredOutput(kind, text)
    except ValueError as exc:
        raise RequestError(f"{param}: {exc}", param) from None
