"""The default model's start-up costs: preparing it into a cold cache, and loading it in a fresh
process from the raw wheel GGUF (the baseline) vs from the prepared directory.

    .venv/bin/python bench/default_model_bench.py [--repeats 3]

Rows (min and median of the repeats, each in a fresh process so nothing is warm but the page
cache; raw and prepared runs alternate):
- prepare: `ensure_default_model` into an empty cache (verify sha256, write the slim GGUF and
  the tokenizer files, check them).
- open: `open_checkpoint` + tokenizer + config — what the router does at start.
- engine load: `LLMEngine(...)` (it opens the checkpoint itself, then builds the model,
  dequantises the weights into it, allocates the KV cache) — a worker's model load.
- worker ready: `python -m decode_worker --model ...` spawned to its PDSERVE_READY line (Python
  and torch imports included).
Writes bench/results/default_model.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import print_table, write_json  # noqa: E402
from pdserve.default_model import ensure_default_model, source_file  # noqa: E402
from pdserve.serving.ready import READY_PREFIX  # noqa: E402

_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from pdserve.engine.checkpoint import open_checkpoint
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
t1 = time.perf_counter()
ck = open_checkpoint(sys.argv[1]); ck.tokenizer(); ck.model_config
t2 = time.perf_counter()
LLMEngine(EngineConfig(model=sys.argv[1], num_gpu_blocks=256, dtype="float32"))
t3 = time.perf_counter()
print(json.dumps({"open_s": t2 - t1, "engine_load_s": t3 - t2}))
"""


def _env() -> dict:
    root = str(Path(__file__).resolve().parent.parent)
    return {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "2"}


def prepare_once() -> float:
    with tempfile.TemporaryDirectory() as cache:
        code = ("import sys, time; from pdserve.default_model import ensure_default_model; "
                "t = time.perf_counter(); ensure_default_model(sys.argv[1], progress=None); "
                "print(time.perf_counter() - t)")
        out = subprocess.run([sys.executable, "-c", code, cache], env=_env(), check=True,
                             capture_output=True, text=True)
        return float(out.stdout.strip())


def load_once(model: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(model)], env=_env(), check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def worker_ready_once(model: Path) -> float:
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "decode_worker", "--model", str(model),
                             "--num-gpu-blocks", "256", "--dtype", "float32", "--threads", "2",
                             "--metrics-port", "-1"], env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        for line in proc.stdout:
            if line.startswith(READY_PREFIX):
                return time.perf_counter() - t0
        raise RuntimeError(f"decode worker exited with {proc.wait()} before it was ready")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output", default="bench/results/default_model.json")
    a = ap.parse_args()
    prepared, raw = ensure_default_model(), source_file()
    prep = [prepare_once() for _ in range(a.repeats)]
    rows = [{"step": "prepare (cold cache)", "prepared_min_s": min(prep),
             "prepared_median_s": statistics.median(prep)}]
    sources = {"raw": raw, "prepared": prepared}
    # Raw and prepared alternate, so a burst of load on this shared machine hits both.
    loads: dict[str, list[dict]] = {name: [] for name in sources}
    ready: dict[str, list[float]] = {name: [] for name in sources}
    for _ in range(a.repeats):
        for name, path in sources.items():
            loads[name].append(load_once(path))
            ready[name].append(worker_ready_once(path))
    series = {label: {name: [x[key] for x in loads[name]] for name in sources}
              for key, label in (("open_s", "open (router)"),
                                 ("engine_load_s", "engine load (worker)"))}
    series["decode worker ready"] = ready
    for label, by in series.items():
        rows.append({"step": label, "raw_min_s": min(by["raw"]),
                     "prepared_min_s": min(by["prepared"]),
                     "raw_median_s": statistics.median(by["raw"]),
                     "prepared_median_s": statistics.median(by["prepared"]),
                     "raw_over_prepared_min": min(by["raw"]) / min(by["prepared"])})
    print(f"\nDefault model start-up (SmolLM2-135M-Instruct Q4_1, fp32, {a.repeats} runs; "
          f"load average {os.getloadavg()[0]:.1f})")
    print_table(rows, ["step", "raw_min_s", "prepared_min_s", "raw_over_prepared_min",
                       "raw_median_s", "prepared_median_s"])
    out = write_json(a.output, {"rows": rows, "prepare_s": prep, "loads": loads,
                                "ready_s": ready})
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
