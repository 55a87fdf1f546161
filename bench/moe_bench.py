"""MoE decode throughput: the grouped experts path vs the per-token loop, in one run.

    python bench/moe_bench.py [--steps 16] [--repeats 3] [--output bench/results/moe.json]

The model is a random Mixtral-shaped checkpoint built with transformers (4 layers, hidden
512, 8 experts of width 1024, top-2, 8 query / 2 KV heads, fp32), saved once under
`--model-dir`. One engine serves every row; `set_experts_impl` switches how its MoE blocks
run between rows:
- grouped: the (token, choice) pairs are sorted by expert and each expert runs once per step
  over all of its tokens;
- per_token: each token runs each of its 2 experts on its own row (the reference loop).

Each request has a 32-token prompt; the prefill step is excluded and `--steps` decode steps
are timed (greedy), at batch 1 and 16. The two paths are timed `--repeats` times,
interleaved, and the best run counts (the machine may be shared). Greedy tokens are checked
equal between the paths.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import print_table, write_json  # noqa: E402
from pdserve.demo_model import write_tokenizer_files  # noqa: E402
from pdserve.engine import LLM, SamplingParams  # noqa: E402
from pdserve.engine.models.moe import set_experts_impl  # noqa: E402

VOCAB = 512
SHAPE = dict(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=2, num_local_experts=8,
             num_experts_per_tok=2, max_position_embeddings=1024, initializer_range=0.1)
IMPLS = ("per_token", "grouped")


def ensure_model(model_dir: Path) -> Path:
    if (model_dir / "config.json").is_file():
        return model_dir
    import transformers

    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**SHAPE))
    model.save_pretrained(model_dir)
    write_tokenizer_files(model_dir, vocab_size=VOCAB)
    return model_dir


def decode(llm: LLM, batch: int, steps: int, prompt_len: int = 32
           ) -> tuple[float, list[list[int]]]:
    """(decode tokens/s over `steps` steps after the prefill step, each request's tokens)."""
    rng = random.Random(batch)
    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    ids = [f"b{batch}-{i}-{time.monotonic_ns()}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, [rng.randrange(4, VOCAB) for _ in range(prompt_len)], params)
    tokens = {rid: [] for rid in ids}
    for out in engine.step():  # the whole batch's prefill (fits one step), first tokens
        tokens[out.request_id] += out.new_token_ids
    count, t0 = 0, time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            count += len(out.new_token_ids)
    dt = time.perf_counter() - t0
    assert count == batch * steps, count
    return count / dt, [tokens[r] for r in ids]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: steadier on a shared machine)")
    ap.add_argument("--model-dir", default="bench/results/moe_model")
    ap.add_argument("--output", default="bench/results/moe.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model_dir = ensure_model(Path(a.model_dir))
    llm = LLM(str(model_dir), dtype="float32", enable_prefix_caching=False,
              num_gpu_blocks=256)
    model = llm.engine.runner.model
    rows = []
    for batch in (1, 16):
        best: dict[str, float] = {}
        outputs: dict[str, list[list[int]]] = {}
        for impl in IMPLS:  # warm-up
            set_experts_impl(model, impl)
            decode(llm, batch, 2)
        for _ in range(a.repeats):
            for impl in IMPLS:
                set_experts_impl(model, impl)
                tok_s, outputs[impl] = decode(llm, batch, a.steps)
                best[impl] = max(best.get(impl, 0.0), tok_s)
        for impl in IMPLS:
            rows.append({"batch": batch, "experts": impl, "decode_tok_s": best[impl],
                         "vs_per_token": best[impl] / best["per_token"],
                         "same_output": outputs[impl] == outputs["per_token"]})
    print(f"\nMoE decode ({model_dir.name}: {SHAPE['num_hidden_layers']} layers, hidden "
          f"{SHAPE['hidden_size']}, {SHAPE['num_local_experts']} experts top-"
          f"{SHAPE['num_experts_per_tok']}, fp32, greedy, {torch.get_num_threads()} threads)")
    print_table(rows, ["batch", "experts", "decode_tok_s", "vs_per_token", "same_output"])
    print(f"\nwrote {write_json(a.output, {'shape': SHAPE, 'steps': a.steps, 'rows': rows})}")


if __name__ == "__main__":
    main()
