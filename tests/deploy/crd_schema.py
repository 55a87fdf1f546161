"""Strict validation of custom resources against the vendored CRD schemas (tests/deploy/crds):
what the API server does with `kubectl apply --validate=strict`, without a cluster.

A CRD's structural schema prunes unknown fields silently; strict validation rejects them, so
every object node that lists `properties` (and does not preserve unknown fields) gets
`additionalProperties: false` here. `x-kubernetes-int-or-string` takes an int or a string,
`nullable` takes null. `metadata` is checked as Kubernetes does for every object: a name.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

import jsonschema

CRDS = Path(__file__).resolve().parent / "crds"


@functools.cache
def _schemas() -> dict[tuple[str, str], dict]:
    out = {}
    for path in CRDS.glob("*.json"):
        d = json.loads(path.read_text())
        out[(d["apiVersion"], d["kind"])] = _strict(copy.deepcopy(d["schema"]))
    return out


def known(api_version: str, kind: str) -> bool:
    return (api_version, kind) in _schemas()


def _strict(node):
    if isinstance(node, list):
        return [_strict(v) for v in node]
    if not isinstance(node, dict):
        return node
    node = {k: _strict(v) for k, v in node.items()}
    if node.pop("x-kubernetes-int-or-string", False):
        node.pop("type", None)
        node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.pop("nullable", False) and "type" in node:
        node["type"] = [node["type"], "null"]
    if node.get("type") == "object" and "properties" in node and \
            not node.get("x-kubernetes-preserve-unknown-fields") and \
            "additionalProperties" not in node:
        node["additionalProperties"] = False
    return node


def validate(obj: dict) -> list[str]:
    """The violations of `obj` against its CRD's schema (empty = valid)."""
    schema = _schemas()[(obj["apiVersion"], obj["kind"])]
    if not (obj.get("metadata") or {}).get("name"):
        return ["metadata.name: required"]
    body = {k: v for k, v in obj.items() if k != "metadata"}
    schema = {**schema, "properties": {**schema.get("properties", {}),
                                       "metadata": {"type": "object"}}}
    validator = jsonschema.Draft7Validator(schema)
    return [f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
            for e in validator.iter_errors({**body, "metadata": obj["metadata"]})]
