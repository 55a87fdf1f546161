"""deploy/Dockerfile, without Docker: hadolint passes it; its base image is an exact tag; it pins
the torch that pyproject.toml pins (CPU wheel), installs the runtime dependencies under the
constraints file (every one of them pinned) and never the dev ones, runs as a numeric non-root
user, holds no model, starts `pdserve`, and its build context lets in every package the wheel
ships. Then the Kubernetes side: every pdserve Deployment the Helm chart renders runs a role
that this entrypoint really has, with flags that role takes, from the chart's image."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML is not installed")

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order; continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in DOCKERFILE.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        keyword, _, rest = (pending + line).strip().partition(" ")
        out.append((keyword.upper(), rest.strip()))
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"
    return out


def final_stage() -> list[tuple[str, str]]:
    steps = instructions()
    last_from = max(i for i, (k, _) in enumerate(steps) if k == "FROM")
    return steps[last_from:]


def arg_defaults(steps: list[tuple[str, str]]) -> dict[str, str]:
    out = {}
    for k, rest in steps:
        if k == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            out[name] = value.strip('"')
    return out


def runs(steps: list[tuple[str, str]]) -> list[str]:
    return [rest for k, rest in steps if k == "RUN"]


def torch_pin() -> str:
    (pin,) = [r for r in PROJECT["dependencies"] if re.match(r"torch\b", r)]
    return pin.replace(" ", "").removeprefix("torch==")


def test_torch_is_the_pyproject_pin_from_the_pytorch_cpu_index():
    args = arg_defaults(final_stage())
    assert args["TORCH_VERSION"] == torch_pin()
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    (install,) = [r for r in runs(final_stage()) if "torch==" in r]
    argv = shlex.split(install)
    assert argv[argv.index("--index-url") + 1] == "$TORCH_INDEX_URL"
    assert "torch==${TORCH_VERSION}" in argv


def test_every_stage_starts_from_an_exact_python_slim_tag_pyproject_allows():
    steps = instructions()
    kind, base = steps[0]
    assert kind == "ARG"
    image = base.removeprefix("BASE_IMAGE=")
    # An exact release (3.11.N on a named Debian), never a moving tag like 3.11-slim.
    assert re.fullmatch(r"python:3\.11\.\d+-slim-[a-z]+(@sha256:[0-9a-f]{64})?", image), image
    froms = [rest.split()[0] for k, rest in steps if k == "FROM"]
    assert froms and all(f == "${BASE_IMAGE}" for f in froms)
    assert PROJECT["requires-python"] == ">=3.11"


def test_hadolint_passes():
    from tests.deploy.k8s_render import tool

    done = subprocess.run([tool("hadolint"), "--no-color", str(DOCKERFILE)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_runtime_dependencies_install_under_constraints_that_pin_all_of_them():
    sys.path.insert(0, str(ROOT / "deploy" / "tools"))
    try:
        import constraints
    finally:
        sys.path.pop(0)
    (run,) = [r for r in runs(final_stage()) if "tomllib" in r]
    assert "-c /tmp/constraints.txt" in run
    copies = [shlex.split(rest) for k, rest in final_stage() if k == "COPY"]
    assert ["deploy/constraints.txt", "/tmp/constraints.txt"] in copies
    pinned = {}
    for line in (ROOT / "deploy" / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, line  # exact pins only
            pinned[name] = version
    want = constraints.closure(PROJECT["dependencies"] + PROJECT["optional-dependencies"]["ray"])
    assert set(want) <= set(pinned), sorted(set(want) - set(pinned))
    assert "torch" not in pinned  # torch comes from the PyTorch index at the pyproject pin


def _requirements_snippet() -> str:
    """The inline Python that writes requirements.txt from pyproject.toml."""
    (run,) = [r for r in runs(final_stage()) if "tomllib" in r]
    argv = shlex.split(run)
    return argv[argv.index("-c") + 1]


@pytest.mark.parametrize("extras", ["", "ray"])
def test_runtime_requirements_are_pyprojects_without_torch_or_the_dev_extra(extras, tmp_path):
    code = _requirements_snippet()
    out = subprocess.run([sys.executable, "-c", code, str(ROOT / "pyproject.toml"), extras],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    want = [r for r in PROJECT["dependencies"] if re.match(r"[\w.-]+", r)[0] != "torch"]
    assert len(want) == len(PROJECT["dependencies"]) - 1
    if extras:
        want += PROJECT["optional-dependencies"][extras]
    assert out == want
    assert not any(r.startswith(("pytest", "ruff", "transformers")) for r in out)


def test_the_package_installs_without_resolving_again_and_never_with_dev():
    stage = runs(final_stage())
    (wheel,) = [r for r in stage if "/tmp/wheels/" in r]
    assert "--no-deps" in shlex.split(wheel)  # torch and the rest come from the layers above
    assert not any(re.search(r"\[[^\]]*\bdev\b", r) for r in runs(instructions()))


def test_it_runs_as_a_numeric_non_root_user():
    stage = final_stage()
    users = [rest for k, rest in stage if k == "USER"]
    assert users, "no USER: the image would run as root"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) != 0  # runAsNonRoot can only verify a numeric user
    assert not gid or (gid.isdigit() and int(gid) != 0)
    (create,) = [r for r in runs(stage) if "useradd" in r]
    assert f"--uid {uid}" in create and (not gid or f"--gid {gid}" in create)


def test_the_entrypoint_is_the_pdserve_console_script():
    (entrypoint,) = [rest for k, rest in final_stage() if k == "ENTRYPOINT"]
    assert json.loads(entrypoint) == ["pdserve"]  # exec form: signals reach pdserve itself
    assert PROJECT["scripts"]["pdserve"] == "pdserve.cli:main"


def test_no_model_is_baked_in_and_models_is_the_mount_point():
    steps = instructions()
    for k, rest in steps:
        if k in ("COPY", "ADD"):
            assert not shlex.split(rest)[-1].startswith("/models"), rest
    text = " ".join(runs(steps)).lower()
    for fetch in ("huggingface", "hf_hub", "snapshot_download", "demo-model", "wget", "curl"):
        assert fetch not in text, f"the image build fetches something: {fetch}"
    assert any("mkdir -p /models" in r for r in runs(final_stage()))


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern that matches the path or one of its parents wins."""
    parts = path.split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    ignored = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        if any(fnmatch.fnmatchcase(c, pattern.lstrip("!")) for c in candidates):
            ignored = not negated
    return ignored


def test_the_build_context_lets_in_every_package_the_wheel_ships_and_nothing_else():
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    shipped = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    roots = sorted({p.rstrip("*").rstrip(".") for p in shipped})
    assert roots and all((ROOT / r / "__init__.py").exists() for r in roots)
    for root in roots:
        assert not _ignored(f"{root}/__init__.py", patterns), root
        assert _ignored(f"{root}/__pycache__/__init__.cpython-311.pyc", patterns), root
    assert not _ignored("pyproject.toml", patterns)
    assert not _ignored("deploy/constraints.txt", patterns)
    assert not _ignored(PROJECT["readme"], patterns)  # the wheel build reads it
    for kept_out in (".venv/bin/python", ".git/HEAD", "tests/conftest.py", "bench/results/x",
                     "models/llama/model.safetensors", "pdserve.egg-info/PKG-INFO"):
        assert _ignored(kept_out, patterns), kept_out


# -- the Helm chart against the image ------------------------------------------------------

def _pdserve_deployments() -> dict[str, dict]:
    from tests.deploy.k8s_render import render

    objs = render()
    out = {}
    for doc in objs:
        if doc["kind"] == "Deployment":
            pod = doc["spec"]["template"]["spec"]
            if any(c["image"].startswith("pdserve:") for c in pod["containers"]):
                out[doc["metadata"]["name"]] = pod
    return out


def test_the_chart_runs_router_and_both_pools_from_the_package_versions_image():
    chart = yaml.safe_load((ROOT / "deploy" / "helm" / "pdserve" / "Chart.yaml").read_text())
    assert chart["appVersion"] == PROJECT["version"]  # the image tag follows the package
    pods = _pdserve_deployments()
    assert set(pods) == {"pd-pdserve-router", "pd-pdserve-prefill", "pd-pdserve-decode"}
    for pod in pods.values():
        assert pod["containers"][0]["image"] == f"pdserve:{PROJECT['version']}"


# What the console script does with `ROLE --help`, for each role given, in one process (the
# roles share their heavy imports): {role: [exit code, stdout]}.
HELP = """import contextlib, io, json, sys
from pdserve.cli import main
out = {}
for role in sys.argv[1:]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        try:
            code = main([role, "--help"])
        except SystemExit as exc:
            code = exc.code
    out[role] = [code, buf.getvalue()]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def role_help() -> dict[str, tuple[int, str]]:
    roles = sorted({pod["containers"][0]["command"][1]
                    for pod in _pdserve_deployments().values()})
    done = subprocess.run([sys.executable, "-c", HELP, *roles], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, check=True)
    return {role: tuple(v) for role, v in json.loads(done.stdout.splitlines()[-1]).items()}


@pytest.mark.parametrize("deployment", ["pd-pdserve-router", "pd-pdserve-prefill",
                                        "pd-pdserve-decode"])
def test_each_deployment_runs_a_role_the_entrypoint_has_with_flags_it_takes(deployment,
                                                                           role_help):
    pod = _pdserve_deployments()[deployment]
    assert pod["securityContext"]["runAsNonRoot"] is True
    (c,) = pod["containers"]
    (entrypoint,) = [rest for k, rest in final_stage() if k == "ENTRYPOINT"]
    entry, role = c["command"]
    assert entry == json.loads(entrypoint)[0]
    # The role exists if it answers --help with a usage that lists every flag the chart
    # passes (an unknown role is an argparse error, exit 2).
    code, usage = role_help[role]
    assert code == 0, f"{deployment}: `pdserve {role} --help` exited {code}"
    for flag in (a for a in c["args"] if a.startswith("--")):
        assert re.search(rf"{re.escape(flag)}(?![\w-])", usage), f"{deployment}: {flag}"
    uid = [rest for k, rest in final_stage() if k == "USER"][-1].partition(":")[0]
    assert pod["securityContext"]["runAsUser"] == int(uid)  # the image's own user
    for mount in c["volumeMounts"]:
        if mount["name"] == "model":
            assert mount["mountPath"] == "/models" and mount["readOnly"] is True
    model = c["args"][c["args"].index("--model") + 1]
    assert model.startswith("/models/")
