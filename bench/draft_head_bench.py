"""A trained EAGLE head against n-gram speculation on the default model, same prompts, one run.

    python bench/draft_head_bench.py [--head bench/results/eagle-smollm2] [--k 3]
                                     [--output bench/results/draft_head.json]

The head comes from `bench/train_draft_head.py` (fitted on the model's own answers to
`bench.draft_data.TRAIN`); it is measured here on `EVAL`, topics it never saw, as chat
prompts to SmolLM2-135M-Instruct (fp32, greedy, `--max-tokens` each):

- batch 1: the first `--batch1-prompts` EVAL prompts one at a time;
- batch 16: all 16 EVAL prompts in one `generate`.

Configurations: speculation off, n-gram (prompt lookup) and the EAGLE head, each with a fixed
k (`adaptive: false`, so the acceptance figures compare like with like) and with the adaptive
k the engine uses by default. Columns: output tokens/s, speedup against off (same batch, same
run), mean accepted length (tokens emitted per verifying step: drafts accepted + 1) and the
share of drafts accepted. Every configuration runs `--repeats` times, interleaved, best run
counts; greedy outputs are checked equal to speculation off.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import print_table, write_json  # noqa: E402
from bench.draft_data import EVAL, chat  # noqa: E402
from pdserve.engine import LLM, SamplingParams  # noqa: E402

COUNTERS = ("spec_verify_steps", "spec_drafts_proposed", "spec_drafts_accepted")


def configs(head: str, k: int) -> dict[str, dict | None]:
    ngram = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3}
    eagle = {"method": "eagle", "model": head, "num_speculative_tokens": k}
    return {"off": None,
            "ngram": {**ngram, "adaptive": False}, "eagle": {**eagle, "adaptive": False},
            "ngram_adaptive": ngram, "eagle_adaptive": eagle}


def run(llm: LLM, batches: list[list[list[int]]], max_tokens: int
        ) -> tuple[float, list[list[int]], dict]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    before = llm.engine.stats()
    t0 = time.perf_counter()
    outs = [o.token_ids for batch in batches for o in llm.generate(batch, params)]
    dt = time.perf_counter() - t0
    after = llm.engine.stats()
    return dt, outs, {k: after.get(k, 0) - before.get(k, 0) for k in COUNTERS}


def measure(llms: dict[str, LLM], batches, max_tokens: int, repeats: int,
            label: int) -> list[dict]:
    best: dict[str, tuple[float, dict]] = {}
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(repeats):
        for name, llm in llms.items():
            dt, outs, delta = run(llm, batches, max_tokens)
            outputs[name] = outs
            if name not in best or dt < best[name][0]:
                best[name] = (dt, delta)
    useful = sum(len(o) for o in outputs["off"])
    rows = []
    for name, (dt, d) in best.items():
        steps = d["spec_verify_steps"]
        rows.append({
            "batch": label, "config": name, "output_tok_s": useful / dt,
            "speedup_vs_off": best["off"][0] / dt,
            "mean_accepted_len": 1 + d["spec_drafts_accepted"] / steps if steps else None,
            "acceptance": (d["spec_drafts_accepted"] / d["spec_drafts_proposed"]
                           if d["spec_drafts_proposed"] else None),
            "verify_steps": steps, "same_output": outputs[name] == outputs["off"]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", default="bench/results/eagle-smollm2")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch1-prompts", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--output", default="bench/results/draft_head.json")
    a = ap.parse_args()
    if not (Path(a.head) / "config.json").is_file():
        sys.exit(f"no head at {a.head}: run bench/train_draft_head.py --out {a.head} first")
    torch.set_num_threads(a.threads)
    llms = {name: LLM(dtype="float32", max_num_seqs=16, enable_prefix_caching=False,
                      num_gpu_blocks=256,
                      speculative_config=cfg) for name, cfg in configs(a.head, a.k).items()}
    tok = llms["off"].tokenizer
    prompts = [chat(tok, t) for t in EVAL]
    for llm in llms.values():  # warm-up
        llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0))
    rows = measure(llms, [[p] for p in prompts[:a.batch1_prompts]], a.max_tokens,
                   a.repeats, 1)
    rows += measure(llms, [prompts], a.max_tokens, a.repeats, len(prompts))
    print(f"\nEAGLE head {a.head} vs n-gram on SmolLM2-135M-Instruct (fp32, greedy, k={a.k}, "
          f"{a.max_tokens} tokens, {torch.get_num_threads()} threads, unseen EVAL prompts)")
    print_table(rows, ["batch", "config", "output_tok_s", "speedup_vs_off",
                       "mean_accepted_len", "acceptance", "same_output"])
    report = Path(a.head) / "train_report.json"
    extra = {"train_report": str(report)} if report.is_file() else {}
    print(f"\nwrote {write_json(a.output, {'head': a.head, 'k': a.k, 'rows': rows, **extra})}")


if __name__ == "__main__":
    main()
