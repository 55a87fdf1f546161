"""Fit an EAGLE head to the default model (SmolLM2-135M-Instruct) on CPU by self-distillation.

    python bench/train_draft_head.py [--minutes 15] [--out bench/results/eagle-smollm2]

1. the model answers the `bench.draft_data.TRAIN` instructions (greedy, and sampled at
   temperature 0.7 for variety; `--answer-tokens` each) — the head learns the model's own
   text, nothing is downloaded;
2. its final hidden states at every position of every answer (one forward per sequence);
3. `pdserve.engine.spec.heads.fit` trains one EAGLE layer (fc + a decoder layer of the
   model's shape; the model's embedding and LM head, frozen) for what is left of the budget;
4. the head is saved in the EAGLE layout `{"method": "eagle", "model": OUT}` loads, with a
   report (`train_report.json`: time per phase, tokens, losses) next to it.

The budget is wall-clock for all phases together; generation takes roughly a third of it.
Threads: `--threads` (default 2): the machine may be shared.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.draft_data import TRAIN, chat  # noqa: E402
from pdserve.engine import LLM, SamplingParams  # noqa: E402
from pdserve.engine.spec.heads import fit  # noqa: E402


def generate(llm: LLM, answer_tokens: int, budget_s: float) -> list[list[int]]:
    """Prompt + answer token ids: greedy answers, then sampled ones while time is left."""
    prompts = [chat(llm.tokenizer, t) for t in TRAIN]
    seqs, t0 = [], time.perf_counter()
    for temperature in (0.0, 0.7, 1.0):
        for start in range(0, len(prompts), 16):
            if time.perf_counter() - t0 > budget_s:
                return seqs
            batch = prompts[start:start + 16]
            params = [SamplingParams(max_tokens=answer_tokens, temperature=temperature,
                                     seed=start + i if temperature else None)
                      for i in range(len(batch))]
            for p, o in zip(batch, llm.generate(batch, params), strict=True):
                seqs.append(p + o.token_ids)
            print(f"  generated {len(seqs)} answers ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
    return seqs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=15.0)
    ap.add_argument("--answer-tokens", type=int, default=192)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results/eagle-smollm2")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    t_start, budget = time.perf_counter(), a.minutes * 60
    llm = LLM(dtype="float32", max_num_seqs=16, num_gpu_blocks=1024)
    t_load = time.perf_counter() - t_start
    seqs = generate(llm, a.answer_tokens, 0.35 * budget)
    t_gen = time.perf_counter() - t_start - t_load
    traces = fit.collect(llm.engine, seqs)
    t_feat = time.perf_counter() - t_start - t_load - t_gen
    head = fit.new_head(llm.engine)
    left = max(60.0, budget - (time.perf_counter() - t_start))
    cfg = fit.FitConfig(steps=100_000, batch=8, window=96, lr=2e-3, ce_share=0.25,
                        time_budget_s=left)
    # The cosine schedule is set by `steps`: estimate how many fit in the time left.
    probe = fit.fit(head, traces, fit.FitConfig(steps=3, batch=8, window=96, lr=0.0))
    per_step = probe[-1]["s"] / 3
    cfg = dataclasses.replace(cfg, steps=max(10, int(left / per_step * 0.95)))
    print(f"  fitting {cfg.steps} steps ({per_step:.2f} s each)", flush=True)
    records = fit.fit(head, traces, cfg, log=lambda r: print(
        f"  step {r['step']}: reg {r['reg']:.3f} ce {r['ce']:.3f} ({r['s']:.0f} s)",
        flush=True) if r["step"] % 100 == 0 else None)
    out = fit.save(head, fit.head_config(llm.engine), a.out)
    total = time.perf_counter() - t_start
    report = {"minutes_budget": a.minutes, "total_s": total, "load_s": t_load,
              "generate_s": t_gen, "features_s": t_feat, "fit_s": records[-1]["s"],
              "sequences": len(seqs), "tokens": sum(len(s) for s in seqs),
              "fit_steps": records[-1]["step"] + 1, "positions_seen":
              (records[-1]["step"] + 1) * cfg.batch * cfg.window, "threads": a.threads,
              "first": records[0], "last": records[-1], "records": records}
    (out / "train_report.json").write_text(json.dumps(report, indent=1))
    print(f"saved {out} after {total / 60:.1f} min: {len(seqs)} answers, "
          f"{report['fit_steps']} steps; final reg {records[-1]['reg']:.3f} "
          f"ce {records[-1]['ce']:.3f}")


if __name__ == "__main__":
    main()
