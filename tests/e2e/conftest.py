"""The `pdserve up` server the real-model OpenAI tests share (one per session: starting the
real default model's cluster costs more than most of its tests)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from pdserve.default_model import CACHE_DIR_ENV
from tests.helpers.cluster import TEST_SECRET

# A fixed k: with the adaptive policy, seeded samples would not repeat exactly.
SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                   "adaptive": False})
ROOT_PATH = "/llm"


@pytest.fixture(scope="session")
def real_openai_server(default_model_cache, tmp_path_factory):
    """`pdserve up` as a vLLM user types it, on any free ports: n-gram speculation on every
    worker, every prompt prefilled on the prefill worker and handed to the decode worker
    (`--local-prefill-tokens 0`), hermes tool calls, a --root-path. Its printed addresses."""
    tmp = tmp_path_factory.mktemp("real-openai")
    (tmp / "secret").write_text(TEST_SECRET)
    cmd = [sys.executable, "-m", "pdserve", "up", "--port", "0", "--http-port", "0",
           "--threads-per-worker", "1", "--log-dir", str(tmp / "logs"),
           "--cluster-secret-file", str(tmp / "secret"), "--local-prefill-tokens", "0",
           "--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "32",
           "--speculative-config", SPEC, "--enable-auto-tool-choice",
           "--tool-call-parser", "hermes", "--enforce-eager", "--root-path", ROOT_PATH]
    env = {**os.environ, CACHE_DIR_ENV: str(default_model_cache), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    addresses = {}
    try:
        end = time.monotonic() + 600
        while "http" not in addresses and time.monotonic() < end:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"pdserve up exited with {proc.wait()}")
            if m := re.search(r"router\s+grpc://(\S+)", line):
                addresses["grpc"] = m.group(1)
            if m := re.search(r"openai api\s+(http://\S+)/v1", line):
                addresses["http"] = m.group(1)
        yield addresses
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
