"""Where a decode step's time goes: torch.profiler over decode steps of the real default model.

    .venv/bin/python bench/profile_decode.py [--batch 1 32] [--steps 8] [--threads 2]
        [--attention auto|torch|cpu] [--quantization int4|fp8] [--lm-head-dtype auto]
        [--trace DIR]

For each batch size: prefill the batch (128-token prompts), then profile `--steps` decode
steps of `LLMEngine.step()` and print the top operators by self CPU time, plus the share of
the step spent outside any torch operator (Python between ops). `--trace DIR` also writes a
Chrome trace per batch size. Writes bench/results/profile_decode.json.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import print_table, write_json  # noqa: E402
from pdserve.engine import LLM, SamplingParams  # noqa: E402


def _prefilled(llm: LLM, batch: int, prompt_len: int, steps: int) -> None:
    rng = random.Random(batch)
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        ids = [rng.randrange(4, 4096) for _ in range(prompt_len)]
        llm.engine.add_request(f"p{batch}-{i}", ids, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens
              for r in llm.engine.scheduler.requests.values()):
        llm.engine.step()
    llm.engine.step()  # one warm decode step


def profile_batch(llm: LLM, batch: int, steps: int, trace: Path | None) -> dict:
    _prefilled(llm, batch, 128, steps)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            llm.engine.step()
        wall = time.perf_counter() - t0
    for rid in list(llm.engine.scheduler.requests):
        llm.engine.abort(rid)
    events = prof.key_averages()
    top_level = sum(e.self_cpu_time_total for e in events) / 1e6
    rows = [{"op": e.key[:48], "calls/step": e.count / steps,
             "self_ms/step": e.self_cpu_time_total / 1e3 / steps,
             "share": e.self_cpu_time_total / 1e6 / wall}
            for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:18]]
    if trace is not None:
        trace.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace / f"decode_b{batch}.json"))
    return {"batch": batch, "step_ms": wall / steps * 1e3,
            "in_ops_share": top_level / wall, "ops": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--quantization", default=None, help="e.g. int4 (W4A16), fp8")
    ap.add_argument("--lm-head-dtype", default="auto")
    ap.add_argument("--model", default=None, help="default: the real default model")
    ap.add_argument("--trace", type=Path, default=None)
    ap.add_argument("--output", default="bench/results/profile_decode.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    llm = LLM(a.model, dtype="float32", enable_prefix_caching=False,
              attention_backend=a.attention, quantization=a.quantization,
              lm_head_dtype=a.lm_head_dtype, kv_cache_memory_gb=0.5)  # 32 x 144 tokens fit
    results = []
    for b in a.batch:
        r = profile_batch(llm, b, a.steps, a.trace)
        print(f"\nbatch {b}: {r['step_ms']:.1f} ms/step, {r['in_ops_share']:.0%} of it inside "
              "torch ops (self time)")
        print_table(r["ops"], ["op", "calls/step", "self_ms/step", "share"])
        results.append(r)
    print(f"\nwrote {write_json(a.output, {'profiles': results})}")


if __name__ == "__main__":
    main()
