"""Rendering the Helm chart with the real `helm` binary, and validating what it renders: core
objects with kubernetes-validate --strict, custom resources against the vendored CRD schemas
(tests/deploy/crd_schema.py).

`helm` is found as $PDSERVE_HELM, .tools/bin/helm (deploy/tools/install-tools.sh puts it
there; CI runs that script) or on PATH. Without it a test skips, except under CI, where it
fails: CI must render the chart.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "pdserve"
K8S_VERSION = "1.37.0"
NAMESPACE = "pdserve"
RELEASE = "pd"


def tool(name: str) -> str:
    """Path of a deployment tool binary (helm, hadolint), or skip / fail as above."""
    found = os.environ.get(f"PDSERVE_{name.upper()}") or (
        str(ROOT / ".tools" / "bin" / name) if (ROOT / ".tools" / "bin" / name).exists()
        else shutil.which(name))
    if found:
        return found
    message = f"{name} is not installed: run deploy/tools/install-tools.sh"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


@functools.cache
def _render(values: tuple[str, ...], sets: tuple[str, ...]) -> str:
    argv = [tool("helm"), "template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    for v in values:
        argv += ["-f", str(CHART / v)]
    for s in sets:
        argv += ["--set", s]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RenderError(done.stderr)
    return done.stdout


class RenderError(RuntimeError):
    pass


def render(*values: str, sets: tuple[str, ...] = ()) -> list[dict]:
    """The objects `helm template` renders for these values files and --set overrides."""
    return [d for d in yaml.safe_load_all(_render(tuple(values), tuple(sets))) if d]


def violations(obj: dict) -> list[str]:
    """Strict validation of one object: [] when valid."""
    import kubernetes_validate

    from tests.deploy import crd_schema

    if crd_schema.known(obj["apiVersion"], obj["kind"]):
        return crd_schema.validate(obj)
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        return [f"no schema for {obj['apiVersion']} {obj['kind']}"]
    except kubernetes_validate.ValidationError as exc:
        return [str(exc).splitlines()[0]]
    return []


def by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}
