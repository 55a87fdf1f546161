"""Speculative decoding: n-gram speculation vs off, in one run.

    python bench/spec_bench.py [--batch 32] [--output bench/results/spec.json]
    python bench/spec_bench.py --real [--max-tokens 96] [--output bench/results/spec_real.json]

Rows:
- batch 1: one prompt of code with repeated identifiers, 128 new tokens (greedy): output
  tokens/s with speculation off, n-gram with a fixed k, and n-gram with adaptive k; the mean
  accepted length (tokens emitted per verifying step, drafts accepted + 1).
- batch N: ragged prompts (code snippets and random token ids, 16..400 tokens) and ragged
  max_tokens (16..96): adaptive n-gram speculation vs off (the goal: never below 0.95x).

- `--real`: the real default model (SmolLM2-135M-Instruct) at batch 1 on real text instead,
  two prompts: a code continuation (the code prompt above, as raw text) and a chat request to
  repeat a passage with one edit (the instruct model copies most of it back, which is what
  prompt-lookup speculation exists for). Same columns; no batch-N rows.

Every configuration is timed `--repeats` times, interleaved with the others, and the best run
counts (the machine may be shared; `--threads 1` by default for the same reason). Greedy
outputs are checked equal to speculation off.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import print_table, write_json  # noqa: E402
from pdserve.demo_model import ensure_demo_model  # noqa: E402
from pdserve.engine import LLM, SamplingParams  # noqa: E402
from pdserve.engine.checkpoint import open_checkpoint  # noqa: E402
from pdserve.tokenizer import Tokenizer  # noqa: E402

K = 4
CONFIGS = {
    "off": None,
    "ngram_fixed": {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3,
                    "adaptive": False},
    "ngram_adaptive": {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3},
}

CODE = '''
def merge_request_batches(request_batches, request_budget):
    merged_requests = []
    for request_batch in request_batches:
        for request in request_batch.requests:
            if request.num_tokens <= request_budget:
                merged_requests.append(request)
                request_budget -= request.num_tokens
    return merged_requests


def split_request_batches(request_batches, request_budget):
    split_requests = []
    for request_batch in request_batches:
        for request in request_batch.requests:
            if request.num_tokens > request_budget:
'''


EDIT_PASSAGE = (
    "The library will be closed on Monday for the public holiday and will reopen on Tuesday "
    "morning at nine. Books due on Monday can be returned on Tuesday without a fine, and the "
    "reading room will stay open until eight in the evening for the rest of the week.")


def edit_prompt(tok: Tokenizer) -> list[int]:
    """A chat request to repeat a passage with one word changed (real-model rows)."""
    ask = ("Repeat the following passage exactly, but replace 'Tuesday' with 'Wednesday':\n\n"
           + EDIT_PASSAGE)
    return tok.encode_chat([{"role": "user", "content": ask}])


def code_prompt(tok: Tokenizer, variant: int = 0) -> list[int]:
    text = CODE if variant == 0 else CODE.replace("request", ["block", "token", "seq"][variant % 3])
    return tok.encode(text)


def batch_workload(tok: Tokenizer, batch: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = []
    for i in range(batch):
        if i % 2 == 0:
            ids = code_prompt(tok, i // 2)
            prompts.append(ids[: rng.randint(16, len(ids))])
        else:
            prompts.append([rng.randrange(4, vocab) for _ in range(rng.randint(16, 400))])
    return prompts, [rng.randint(16, 96) for _ in range(batch)]


def timed(llm: LLM, prompts, max_new) -> tuple[float, list[list[int]], dict]:
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_new]
    before = llm.engine.stats()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    after = llm.engine.stats()
    delta = {k: after[k] - before[k] for k in ("spec_verify_steps", "spec_drafts_proposed",
                                               "spec_drafts_accepted")}
    return dt, [o.token_ids for o in outs], delta


def run_rows(model_dir: Path, prompts, max_new, names: list[str], repeats: int,
             label: str | None = None, num_gpu_blocks: int | None = None) -> list[dict]:
    # Dense fp32 (the figures in docs/perf.md are fp32; a Q4 GGUF would run int4 by default).
    llms = {n: LLM(str(model_dir), dtype="float32", enable_prefix_caching=False,
                   speculative_config=CONFIGS[n], num_gpu_blocks=num_gpu_blocks,
                   quantization="none")
            for n in names}
    for llm in llms.values():
        llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    best: dict[str, tuple[float, dict]] = {}
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(repeats):
        for n, llm in llms.items():
            dt, toks, delta = timed(llm, prompts, max_new)
            outputs[n] = toks
            if n not in best or dt < best[n][0]:
                best[n] = (dt, delta)
    useful = sum(max_new)
    rows = []
    for n in names:
        dt, d = best[n]
        tag = {} if label is None else {"prompt": label}
        steps = d["spec_verify_steps"]
        rows.append({
            **tag, "batch": len(prompts), "config": n, "output_tok_s": useful / dt,
            "vs_off": best["off"][0] / dt,
            "mean_accepted_len": (1 + d["spec_drafts_accepted"] / steps) if steps else None,
            "acceptance": (d["spec_drafts_accepted"] / d["spec_drafts_proposed"]
                           if d["spec_drafts_proposed"] else None),
            "same_output": outputs[n] == outputs["off"]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: steadier on a shared machine)")
    ap.add_argument("--model", default=None, help="default: the demo model")
    ap.add_argument("--real", action="store_true",
                    help="the real default model on real text, batch 1 only")
    ap.add_argument("--max-tokens", type=int, default=128, help="new tokens per batch-1 row")
    ap.add_argument("--output", default=None,
                    help="default: bench/results/spec.json (spec_real.json with --real)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.real:
        real_rows(a)
        return
    model_dir = Path(a.model) if a.model else ensure_demo_model()
    tok = open_checkpoint(model_dir).tokenizer()
    rows = run_rows(model_dir, [code_prompt(tok)], [a.max_tokens], list(CONFIGS), a.repeats)
    prompts, max_new = batch_workload(tok, a.batch, tok.vocab_size)
    rows += run_rows(model_dir, prompts, max_new, ["off", "ngram_adaptive"], a.repeats)
    print(f"\nn-gram speculation ({model_dir.name}, fp32, greedy, k <= {K}, "
          f"{torch.get_num_threads()} threads)")
    print_table(rows, ["batch", "config", "output_tok_s", "vs_off", "mean_accepted_len",
                       "acceptance", "same_output"])
    print(f"\nwrote {write_json(a.output or 'bench/results/spec.json', {'rows': rows})}")


def real_rows(a: argparse.Namespace) -> None:
    from pdserve.default_model import ensure_default_model

    model_dir = ensure_default_model()
    tok = open_checkpoint(model_dir).tokenizer()
    rows = []
    for label, prompt in (("code continuation", tok.encode(CODE)),
                          ("repeat/edit passage", edit_prompt(tok))):
        # A small KV cache each (one request): three engines at the default 1 GiB each do not
        # fit beside other work on a 24 GiB machine.
        blocks = -(-(len(prompt) + a.max_tokens + 8) // 16) + 4
        rows += run_rows(model_dir, [prompt], [a.max_tokens], list(CONFIGS), a.repeats, label,
                         num_gpu_blocks=blocks)
    print(f"\nn-gram speculation at batch 1 ({model_dir.name}, fp32, greedy, "
          f"{a.max_tokens} new tokens, k <= {K}, {torch.get_num_threads()} threads, "
          f"load average {os.getloadavg()[0]:.1f})")
    print_table(rows, ["prompt", "config", "output_tok_s", "vs_off", "mean_accepted_len",
                       "acceptance", "same_output"])
    out = write_json(a.output or "bench/results/spec_real.json",
                     {"model": model_dir.name, "max_tokens": a.max_tokens, "rows": rows,
                      "load_average": os.getloadavg()[0]})
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
