"""The processes that never run a model load no torch: the router (imported, and after it has
read a checkpoint's configuration and tokenizer, as it does at start), `pdserve` commands and
the launchers, and the Ray supervisors. torch costs 2-4 s of CPU on every start of each (a
restarted router, `pdserve ray status`, `pdserve --help`), on the same cores as the workers'
model loads. Each check runs in a fresh interpreter: this test process has torch already."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_CHECK = """
import importlib, sys
for name in sys.argv[2:]:
    importlib.import_module(name)
if sys.argv[1]:
    from pdserve.engine.checkpoint import open_checkpoint
    ck = open_checkpoint(sys.argv[1])
    ck.model_config, ck.eos_token_ids, ck.tokenizer().encode("hello")
print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers")))
"""

LIGHT = ["router.__main__", "pdserve.cli", "pdserve.launcher", "pdserve.supervisor",
         "pdserve.deploy.cli", "pdserve.deploy.process", "pdserve.serving.worker_options"]


def _heavy_modules(checkpoint: str, *modules: str) -> str:
    done = subprocess.run([sys.executable, "-c", _CHECK, checkpoint, *modules], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_router_commands_and_launchers_import_no_torch():
    assert _heavy_modules("", *LIGHT) == "[]"


def test_reading_a_checkpoints_configuration_and_tokenizer_needs_no_torch(tiny_llama, tmp_path):
    from pdserve.engine.checkpoint.gguf_names import is_linear
    from tests.helpers.gguf_files import gguf_from_hf

    q4 = gguf_from_hf(tiny_llama, tmp_path / "q4.gguf", "llama",
                      lambda name: "Q4_1" if is_linear(name) else "F32")
    for checkpoint in (tiny_llama, q4):
        assert _heavy_modules(str(checkpoint), "router.__main__") == "[]", checkpoint


def test_the_help_of_every_command_needs_no_torch():
    code = ("import runpy, sys; sys.argv = ['pdserve', '--help']\n"
            "try:\n    runpy.run_module('pdserve', run_name='__main__')\n"
            "except SystemExit:\n    pass\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "usage" in done.stdout, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
