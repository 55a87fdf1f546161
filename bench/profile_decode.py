"""Where a decode step's time goes: torch.profiler over decode steps of the real default model.

    .venv/bin/python bench/profile_decode.py [--batch 1 32] [--steps 8] [--threads 2]
        [--attention auto|torch|cpu] [--quantization int4|fp8] [--lm-head-dtype auto]
        [--trace DIR] [--ragged]

For each batch size: prefill the batch (128-token prompts), then profile `--steps` decode
steps of `LLMEngine.step()` and print the top operators by self CPU time, plus the share of
the step spent outside any torch operator (Python between ops). `--ragged` profiles instead
the whole batch-32 ragged workload of bench/decode_bench.py (prompts 16..512, max_tokens
16..128), prefill included: its wall time split into steps that carry prompt tokens and
decode-only steps, and the top operators over the run. `--trace DIR` also writes a Chrome
trace per profile. Writes bench/results/profile_decode.json.
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
from bench.engine_bench import workload  # noqa: E402
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
    _export(prof, trace, f"decode_b{batch}.json")
    return {"batch": batch, "step_ms": wall / steps * 1e3,
            "in_ops_share": _in_ops(prof) / wall, "ops": _top_ops(prof, steps, wall)}


def profile_ragged(llm: LLM, trace: Path | None) -> dict:
    """decode_bench's batch-32 ragged workload, run to the end step by step: seconds in steps
    that carry prompt tokens (prefill chunks, with the decode rows batched beside them) and
    in decode-only steps, and the top operators over the whole run."""
    prompts, max_new = workload(32)
    for i, (ids, m) in enumerate(zip(prompts, max_new, strict=True)):
        llm.engine.add_request(f"ragged-{i}", ids, SamplingParams(
            max_tokens=m, temperature=0.0, ignore_eos=True))
    split = {"prefill": [0.0, 0], "decode": [0.0, 0]}
    with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
        t0 = time.perf_counter()
        while llm.engine.has_unfinished():
            plan = llm.engine.plan()
            kind = "prefill" if any(len(c.token_ids) > 1 for c in plan.chunks) else "decode"
            s0 = time.perf_counter()
            llm.engine.apply_results(plan, *llm.engine.execute(plan))
            split[kind][0] += time.perf_counter() - s0
            split[kind][1] += 1
        wall = time.perf_counter() - t0
    _export(prof, trace, "ragged_b32.json")
    steps = sum(n for _, n in split.values())
    return {"wall_s": wall, "in_ops_share": _in_ops(prof) / wall,
            "split": [{"steps": k, "count": n, "seconds": t, "share": t / wall}
                      for k, (t, n) in split.items()],
            "ops": _top_ops(prof, steps, wall)}


def _in_ops(prof) -> float:
    return sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e6


def _top_ops(prof, steps: int, wall: float) -> list[dict]:
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:18]
    return [{"op": e.key[:48], "calls/step": e.count / steps,
             "self_ms/step": e.self_cpu_time_total / 1e3 / steps,
             "share": e.self_cpu_time_total / 1e6 / wall} for e in events]


def _export(prof, trace: Path | None, name: str) -> None:
    if trace is not None:
        trace.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace / name))


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
    ap.add_argument("--ragged", action="store_true",
                    help="profile decode_bench's batch-32 ragged workload, prefill included")
    ap.add_argument("--output", default="bench/results/profile_decode.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    llm = LLM(a.model, dtype="float32", enable_prefix_caching=False,
              attention_backend=a.attention, quantization=a.quantization,
              lm_head_dtype=a.lm_head_dtype,
              kv_cache_memory_gb=1.0 if a.ragged else 0.5)  # 32 x 640 / 32 x 144 tokens fit
    if a.ragged:
        _prefilled(llm, 2, 16, 2)  # warm
        for rid in list(llm.engine.scheduler.requests):
            llm.engine.abort(rid)
        r = profile_ragged(llm, a.trace)
        print(f"\nragged batch 32: {r['wall_s']:.1f} s, {r['in_ops_share']:.0%} of it inside "
              "torch ops (self time)")
        print_table(r["split"], ["steps", "count", "seconds", "share"])
        print_table(r["ops"], ["op", "calls/step", "self_ms/step", "share"])
        print(f"\nwrote {write_json(a.output, {'ragged': r})}")
        return
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
