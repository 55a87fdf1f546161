"""The runbooks (docs/runbooks/) are true: every command in their shell blocks is one the tools
take. `pdserve ...` lines are parsed by the real CLI's argparse (and `pdserve ray up` lines
built into a deployment by the real schema); `helm install|upgrade` lines are rendered by the
real helm against the chart (so every --set key passes values.schema.json); `kubectl` lines
name the namespace; `ray start` flags exist; files they name exist. Python blocks compile and
their imports resolve. The README's deployment commands are held to the same rules."""

from __future__ import annotations

import argparse
import ast
import importlib
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNBOOKS = sorted((ROOT / "docs" / "runbooks").glob("*.md"))
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
SUBST = re.compile(r"\$\([^()]*\)")
OPERATORS = {"&&", "||", ";", "|", "&", "(", ")"}


def blocks(path: Path, languages: tuple[str, ...]) -> list[str]:
    return [body for lang, body in FENCE.findall(path.read_text()) if lang in languages]


def commands(script: str) -> list[list[str]]:
    """Every simple command of a shell block, as argv (command substitutions flattened to a
    placeholder word, continuation lines joined, comments dropped)."""
    out = []
    for line in script.replace("\\\n", " ").splitlines():
        line = SUBST.sub("SUBST", line).strip()
        if not line or line.startswith("#"):
            continue
        lex = shlex.shlex(line, posix=True, punctuation_chars=";&|()")
        lex.whitespace_split = True
        lex.commenters = "#"
        argv: list[str] = []
        for token in lex:
            if token in OPERATORS:
                if argv:
                    out.append(argv)
                argv = []
            else:
                argv.append(token)
        if argv:
            out.append(argv)
    return [a for a in out if not re.fullmatch(r"[A-Z_]+=.*", a[0]) and a[0] != "export"]


def all_commands(tool: str) -> list[tuple[str, list[str]]]:
    found = []
    for path in [*RUNBOOKS, ROOT / "README.md"]:
        for block in blocks(path, ("bash", "sh", "shell")):
            for argv in commands(block):
                name = Path(argv[0]).name
                if name == tool:
                    found.append((f"{path.name}: {shlex.join(argv)}", argv))
    return found


def test_the_runbooks_exist_and_their_shell_is_in_fenced_blocks():
    names = {p.name for p in RUNBOOKS}
    assert {"ray.md", "kubernetes.md", "incidents.md", "production-checklist.md",
            "scaling-prefill.md", "scaling-decode.md", "redis.md"} <= names
    for path in RUNBOOKS:
        text = FENCE.sub("", path.read_text())
        for line in text.splitlines():  # an unfenced command would escape these checks
            assert not re.match(r"^ {4}(pdserve|kubectl|helm|ray) ", line), f"{path.name}: {line}"


# -- pdserve ------------------------------------------------------------------------------------

def _parse_pdserve(argv: list[str], monkeypatch) -> argparse.Namespace | None:
    """Parse `pdserve ARGV` exactly as the console script does, running nothing."""
    import pdserve.cli as cli

    roles = {"router": _parse_router, "prefill-worker": _parse_worker,
             "decode-worker": _parse_worker}
    if argv and argv[0] in roles:
        roles[argv[0]](argv[1:])
        return None
    seen: list[argparse.Namespace] = []
    for name in ("cmd_up", "cmd_generate", "cmd_bench", "cmd_demo_model", "cmd_ray"):
        monkeypatch.setattr(cli, name, lambda a: seen.append(a) or 0)
    assert cli.main(argv) == 0
    return seen[0]


def _parse_router(argv: list[str]) -> None:
    from router.__main__ import parse

    parse(argv)


def _parse_worker(argv: list[str]) -> None:
    from pdserve.serving.worker_options import add_worker_args

    p = argparse.ArgumentParser(allow_abbrev=False)
    add_worker_args(p)
    p.parse_args(argv)


PDSERVE = all_commands("pdserve")


def test_the_runbooks_show_pdserve_commands():
    assert len(PDSERVE) >= 15
    assert {a[1] for _, a in PDSERVE if len(a) > 1} >= {"ray", "generate"}


@pytest.mark.parametrize("where, argv", PDSERVE, ids=[w for w, _ in PDSERVE])
def test_each_pdserve_command_is_one_the_cli_takes(where, argv, monkeypatch):
    try:
        a = _parse_pdserve(argv[1:], monkeypatch)
    except SystemExit as exc:
        pytest.fail(f"{where}: argparse refused it (exit {exc.code})")
    if a is not None and a.cmd == "ray" and a.ray_cmd == "up":
        from pdserve.deploy.cli import up_spec

        monkeypatch.setenv("PDSERVE_REDIS_URL", "redis://:pw@redis:6379/0")
        monkeypatch.chdir(ROOT)
        up_spec(a)  # the deployment it describes is one the schema takes


# -- helm, kubectl, ray, scripts --------------------------------------------------------------

HELM = all_commands("helm")


@pytest.mark.parametrize("where, argv", HELM, ids=[w for w, _ in HELM])
def test_each_helm_command_names_the_namespace_and_renders(where, argv):
    from tests.deploy.k8s_render import tool

    sub = argv[1]
    assert sub in ("install", "upgrade", "template", "uninstall", "history", "rollback"), where
    assert _namespace(argv) == "pdserve", f"{where}: no -n pdserve"
    if sub not in ("install", "upgrade", "template"):
        return
    name, chart, rest = argv[2], argv[3], argv[4:]
    assert (ROOT / chart / "Chart.yaml").exists(), where
    rest = [x for x in rest if x not in ("--reuse-values", "--create-namespace")]
    for i, x in enumerate(rest):
        if x == "-f":
            assert (ROOT / rest[i + 1]).exists(), where
    done = subprocess.run([tool("helm"), "template", name, chart, *rest], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{where}: {done.stderr}"


def _namespace(argv: list[str]) -> str | None:
    for i, x in enumerate(argv):
        if x in ("-n", "--namespace"):
            return argv[i + 1]
        if x.startswith("--namespace="):
            return x.split("=", 1)[1]
    return None


KUBECTL = all_commands("kubectl")


@pytest.mark.parametrize("where, argv", KUBECTL, ids=[w for w, _ in KUBECTL])
def test_each_kubectl_command_names_the_namespace(where, argv):
    if argv[1:3] == ["create", "namespace"]:
        return
    if "--raw" in argv:
        assert "/namespaces/pdserve/" in argv[argv.index("--raw") + 1], where
        return
    assert _namespace(argv) == "pdserve", f"{where}: no -n pdserve"


def test_ray_start_flags_exist():
    lines = all_commands("ray")
    assert lines
    usage = subprocess.run([str(Path(sys.executable).with_name("ray")), "start", "--help"],
                           capture_output=True, text=True, timeout=60).stdout
    for where, argv in lines:
        assert argv[1] == "start", where
        for flag in (x.split("=")[0] for x in argv[2:] if x.startswith("--")):
            assert re.search(rf"{re.escape(flag)}\b", usage), f"{where}: {flag}"


def test_scripts_and_files_the_runbooks_name_exist():
    for path in RUNBOOKS:
        text = path.read_text()
        for ref in set(re.findall(r"(?<![\w/.])((?:deploy|docs|tests|bench)/[\w./-]+\w)", text)):
            if ref.startswith("deploy/pdserve-"):
                continue  # kubectl's deploy/NAME, not a path
            assert (ROOT / ref).exists(), f"{path.name}: {ref}"
        for ref in set(re.findall(r"`([\w-]+\.md)`", text)):
            assert (path.parent / ref).exists() or (ROOT / ref).exists(), f"{path.name}: {ref}"


# -- python ---------------------------------------------------------------------------------------

PYTHON = [(f"{p.name}[{i}]", code) for p in [*RUNBOOKS, ROOT / "README.md"]
          for i, code in enumerate(blocks(p, ("python",)))]


@pytest.mark.parametrize("where, code", PYTHON, ids=[w for w, _ in PYTHON])
def test_each_python_snippet_compiles_and_its_imports_resolve(where, code):
    tree = ast.parse(code, filename=where)
    compile(tree, where, "exec")
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)
        elif isinstance(node, ast.ImportFrom):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{where}: {node.module}.{alias.name}"
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and
            isinstance(n.ctx, ast.Load)}
    bound = {a.asname or a.name.split(".")[0] for n in ast.walk(tree)
             if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    bound |= {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets
              if isinstance(t, ast.Name)}
    bound |= {n.target.id for n in ast.walk(tree) if isinstance(n, (ast.For, ast.comprehension))
              and isinstance(n.target, ast.Name)}
    bound |= {n.optional_vars.id for w in ast.walk(tree) if isinstance(w, ast.With)
              for n in w.items if isinstance(n.optional_vars, ast.Name)}
    import builtins

    missing = used - bound - set(dir(builtins))
    assert not missing, f"{where}: uses {sorted(missing)} without defining or importing them"
