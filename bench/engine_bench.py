"""Engine throughput vs HF transformers on the same checkpoint, in one run.

    python bench/engine_bench.py [--batch 32] [--output bench/results/engine.json]

Rows:
- batch 1: one 128-token prompt, 128 new tokens (greedy), output tokens/s.
- batch 32: ragged prompts (16..512 tokens) and ragged max_tokens (16..128). HF gets the batch
  left-padded and generates until the longest request is done (its only option); both are
  credited with the same useful tokens (the sum of max_tokens).
- decode bandwidth at batch 1 on a larger (few hundred MB) variant: weight bytes read per token
  x tokens/s over this machine's memory copy bandwidth.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import memcpy_bandwidth, print_table, write_json  # noqa: E402
from pdserve.demo_model import ensure_demo_model, write_demo_model  # noqa: E402
from pdserve.engine import LLM, SamplingParams  # noqa: E402
from pdserve.engine.checkpoint import open_checkpoint  # noqa: E402


def hf_run(model, prompts: list[list[int]], max_new: list[int]) -> float:
    """Seconds for HF to generate max(max_new) tokens for the left-padded batch."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max(max_new),
                       min_new_tokens=max(max_new), pad_token_id=0, eos_token_id=None)
    return time.perf_counter() - t0


def ours_run(llm: LLM, prompts, max_new) -> float:
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_new]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    assert [len(o.token_ids) for o in outs] == list(max_new)
    return dt


def workload(batch: int, seed: int = 0):
    rng = random.Random(seed)
    if batch == 1:
        return [[rng.randrange(4, 4096) for _ in range(128)]], [128]
    prompts = [[rng.randrange(4, 4096) for _ in range(rng.randint(16, 512))]
               for _ in range(batch)]
    return prompts, [rng.randint(16, 128) for _ in range(batch)]


def throughput_rows(model_dir: Path, batch: int) -> list[dict]:
    import transformers

    llm = LLM(str(model_dir), dtype="float32", enable_prefix_caching=False)
    if open_checkpoint(model_dir).format == "gguf":  # transformers reads the same file
        gguf = next(model_dir.glob("*.gguf")) if model_dir.is_dir() else model_dir
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    else:
        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir,
                                                               dtype=torch.float32).eval()
    rows = []
    for b in (1, batch):
        prompts, max_new = workload(b)
        ours_run(llm, prompts[:1], [4])  # warm-up
        useful = sum(max_new)
        t_ours = ours_run(llm, prompts, max_new)
        t_hf = hf_run(hf, prompts, max_new)
        rows.append({"batch": b, "useful_tokens": useful, "pdserve_tok_s": useful / t_ours,
                     "hf_tok_s": useful / t_hf, "ratio": t_hf / t_ours})
    return rows


def bandwidth_row(tmp: Path) -> dict:
    # ~75M params, ~300 MB fp32: big enough that weights, not overheads, dominate a step.
    big = write_demo_model(tmp / "big", seed=1, hidden_size=1024, intermediate_size=2816,
                           num_hidden_layers=6, num_attention_heads=16, num_key_value_heads=4)
    llm = LLM(str(big), dtype="float32", enable_prefix_caching=False)
    weight_bytes = sum(p.numel() * p.element_size()
                       for p in llm.engine.runner.model.parameters())
    emb = llm.engine.runner.model.embed_tokens.weight
    weight_bytes -= emb.numel() * emb.element_size()  # an embedding lookup reads one row
    prompts, max_new = [[5] * 16], [128]
    ours_run(llm, prompts, [4])
    dt = ours_run(llm, prompts, max_new)
    tok_s = max_new[0] / dt
    bw = memcpy_bandwidth()
    return {"weight_MB": weight_bytes / 1e6, "tok_s": tok_s,
            "weight_GB_s": weight_bytes * tok_s / 1e9, "memcpy_GB_s": bw / 1e9,
            "utilisation": weight_bytes * tok_s / bw}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--model", default=None, help="default: the demo model")
    ap.add_argument("--output", default="bench/results/engine.json")
    ap.add_argument("--skip-bandwidth", action="store_true")
    a = ap.parse_args()
    model_dir = Path(a.model) if a.model else ensure_demo_model()
    rows = throughput_rows(model_dir, a.batch)
    print(f"\nEngine vs HF transformers ({model_dir.name}, fp32, greedy)")
    print_table(rows, ["batch", "useful_tokens", "pdserve_tok_s", "hf_tok_s", "ratio"])
    result = {"throughput": rows}
    if not a.skip_bandwidth:
        with tempfile.TemporaryDirectory() as tmp:
            bw = bandwidth_row(Path(tmp))
        print("\nDecode bandwidth utilisation at batch 1")
        print_table([bw], ["weight_MB", "tok_s", "weight_GB_s", "memcpy_GB_s", "utilisation"])
        result["bandwidth"] = bw
    print(f"\nwrote {write_json(a.output, result)}")


if __name__ == "__main__":
    main()
