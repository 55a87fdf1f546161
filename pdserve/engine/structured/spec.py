"""`StructuredOutput`: the constraint one request puts on its output. Pure data.

Travels inside `SamplingParams` (msgpack `to_dict`, protobuf `pdserve.v1.StructuredOutput`) so
every worker that samples for the request builds the same grammar from it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_SPEC_CHARS = 256 * 1024
"""Longest schema / regex / grammar text accepted (the compile cost grows with it)."""


class ConstraintKind(enum.Enum):
    JSON_SCHEMA = "json_schema"
    """`spec` is a JSON Schema, as JSON text."""
    JSON_OBJECT = "json_object"
    """Any JSON object (`spec` unused)."""
    REGEX = "regex"
    """`spec` is a regular expression the whole output must match."""
    CHOICE = "choice"
    """The output is exactly one of `choices`."""
    GRAMMAR = "grammar"
    """`spec` is an EBNF (GBNF) grammar whose root rule is `root`."""
    STRUCTURAL_TAG = "structural_tag"
    """`spec` is an xgrammar structural tag (JSON text): free text with constrained spans."""


@dataclass(frozen=True)
class StructuredOutput:
    kind: ConstraintKind
    spec: str = ""
    """The schema / regex / grammar / structural tag text (see `ConstraintKind`)."""
    choices: tuple[str, ...] = ()
    """CHOICE only: the allowed outputs (non-empty strings)."""
    any_whitespace: bool = False
    """JSON kinds: allow any whitespace between tokens (False: compact `, ` / `: ` only, so
    a model cannot loop on whitespace until it runs out of tokens)."""

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ConstraintKind):
            raise ValueError(f"structured.kind must be a ConstraintKind, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise ValueError("structured.spec must be a string")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(f"structured.spec is longer than {MAX_SPEC_CHARS} characters")
        object.__setattr__(self, "choices", tuple(self.choices))
        if self.kind is ConstraintKind.CHOICE:
            if not self.choices or not all(isinstance(c, str) and c for c in self.choices):
                raise ValueError("structured.choices must be a non-empty list of non-empty "
                                 "strings")
        elif self.choices:
            raise ValueError("structured.choices is only for the choice constraint")
        needs_spec = self.kind not in (ConstraintKind.JSON_OBJECT, ConstraintKind.CHOICE)
        if needs_spec and not self.spec:
            raise ValueError(f"structured.spec must not be empty for {self.kind.value}")
        if not isinstance(self.any_whitespace, bool):
            raise ValueError("structured.any_whitespace must be a bool")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "spec": self.spec, "choices": list(self.choices),
                "any_whitespace": self.any_whitespace}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StructuredOutput:
        if not isinstance(d, Mapping):
            raise ValueError("structured must be a mapping")
        try:
            kind = ConstraintKind(d.get("kind"))
        except ValueError:
            raise ValueError(f"structured.kind {d.get('kind')!r} is not one of "
                             f"{[k.value for k in ConstraintKind]}") from None
        return cls(kind, d.get("spec", ""), tuple(d.get("choices", ())),
                   bool(d.get("any_whitespace", False)))
