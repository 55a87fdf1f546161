"""A `StructuredOutput` as an xgrammar `Grammar` (independent of any tokenizer).

The router builds it to validate a request before any worker sees it (an invalid schema,
regex or grammar is a 400 that says why); workers compile the same grammar for their
tokenizer (`compiler.py`). Building parses the spec only: cheap, but still run off an event
loop by callers, since a large schema takes milliseconds.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pdserve.engine.structured.spec import ConstraintKind, StructuredOutput

# xgrammar's errors start with "[hh:mm:ss] /path/to/file.cc:123: "; clients get the rest.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


class InvalidConstraint(ValueError):
    """The schema / regex / grammar cannot be turned into a grammar; the message says why."""


def build_grammar(s: StructuredOutput) -> Any:
    """The xgrammar `Grammar` for `s`; raises InvalidConstraint."""
    import xgrammar as xgr  # only processes that constrain outputs pay for the import

    try:
        if s.kind is ConstraintKind.JSON_SCHEMA:
            return xgr.Grammar.from_json_schema(_schema(s.spec),
                                                any_whitespace=s.any_whitespace)
        if s.kind is ConstraintKind.JSON_OBJECT:
            return xgr.Grammar.from_json_schema({"type": "object"},
                                                any_whitespace=s.any_whitespace)
        if s.kind is ConstraintKind.REGEX:
            return xgr.Grammar.from_regex(s.spec)
        if s.kind is ConstraintKind.CHOICE:
            return xgr.Grammar.from_ebnf(choice_ebnf(s.choices))
        if s.kind is ConstraintKind.GRAMMAR:
            return xgr.Grammar.from_ebnf(s.spec)
        return _structural_tag(xgr, s.spec)
    except InvalidConstraint:
        raise
    except (RuntimeError, ValueError, TypeError, KeyError) as exc:
        raise InvalidConstraint(f"invalid {s.kind.value}: {clean_error(exc)}") from None


def choice_ebnf(choices: tuple[str, ...]) -> str:
    """root ::= "a" | "b" ... (JSON string escapes are valid EBNF literal escapes)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def clean_error(exc: BaseException) -> str:
    """An xgrammar error's message without its C++ source location."""
    text = str(exc).strip()
    return _CPP_PREFIX.sub("", text).strip() or type(exc).__name__


def _schema(text: str) -> Any:
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise InvalidConstraint(f"invalid json_schema: not JSON ({exc})") from None
    if not isinstance(schema, dict | bool):
        raise InvalidConstraint("invalid json_schema: a schema must be an object or a bool")
    return schema


def _structural_tag(xgr: Any, text: str) -> Any:
    """Both spellings: xgrammar's `{"type": "structural_tag", "format": ...}` and the older
    vLLM/OpenAI `{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`."""
    try:
        tag = json.loads(text)
    except ValueError as exc:
        raise InvalidConstraint(f"invalid structural_tag: not JSON ({exc})") from None
    if isinstance(tag, dict) and "structures" in tag:
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})),
                                       end=s["end"]) for s in tag["structures"]]
        return xgr.Grammar.from_structural_tag(items, list(tag.get("triggers", [])))
    return xgr.Grammar.from_structural_tag(text)
