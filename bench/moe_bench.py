"""MoE decode throughput: the grouped experts path vs the per-token loop, and 4-bit (W4A16)
experts vs fp32 experts, in one run.

    python bench/moe_bench.py [--steps 16] [--repeats 3] [--output bench/results/moe.json]

The model is a random Mixtral-shaped checkpoint built with transformers (4 layers, hidden
512, 8 experts of width 1024, top-2, 8 query / 2 KV heads, fp32), saved once under
`--model-dir`. One engine serves every row; `set_experts_impl` switches how its MoE blocks
run between rows:
- grouped: the (token, choice) pairs are sorted by expert and each expert runs once per step
  over all of its tokens;
- per_token: each token runs each of its 2 experts on its own row (the reference loop).

Weights (every row grouped but the per-token one): `fp32`, the engine above; `int4 experts`,
the same fp32 engine whose experts run the methods of a second engine loaded with
`quantization="int4"` (4-bit experts, torch's CPU int4 kernel; attention and everything else
fp32, so the row isolates the experts); `int4`, that second engine itself (attention's linear
layers 4-bit too; router and LM head fp32).

Each request has a 32-token prompt; the prefill step is excluded and `--steps` decode steps
are timed (greedy), at batch 1 and 16. The two paths are timed `--repeats` times,
interleaved, and the best run counts (the machine may be shared). Greedy tokens are checked
equal between the two fp32 paths; the 4-bit rows report whether theirs equal fp32's (their
numerics differ, so they need not).
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
from pdserve.engine.layers.moe import FusedExperts  # noqa: E402
from pdserve.engine.models.moe import set_experts_impl  # noqa: E402

VOCAB = 512
SHAPE = dict(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=2, num_local_experts=8,
             num_experts_per_tok=2, max_position_embeddings=1024, initializer_range=0.1)
VARIANTS = (("fp32", "per_token"), ("fp32", "grouped"), ("int4 experts", "grouped"),
            ("int4", "grouped"))


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


def int4_experts_engine(model_dir: Path, int4: LLM) -> LLM:
    """An fp32 engine whose experts multiply through `int4`'s 4-bit expert methods (the
    methods read none of the layer's own weights), everything else fp32."""
    llm = LLM(str(model_dir), dtype="float32", enable_prefix_caching=False, num_gpu_blocks=256)
    ours = [m for m in llm.engine.runner.model.modules() if isinstance(m, FusedExperts)]
    theirs = [m for m in int4.engine.runner.model.modules() if isinstance(m, FusedExperts)]
    for mine, q in zip(ours, theirs, strict=True):
        mine.method = q.method
    return llm


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
    opts = dict(dtype="float32", enable_prefix_caching=False, num_gpu_blocks=256)
    fp32 = LLM(str(model_dir), **opts)
    int4 = LLM(str(model_dir), quantization="int4", **opts)
    engines = {"fp32": fp32, "int4 experts": int4_experts_engine(model_dir, int4),
               "int4": int4}
    rows = []
    for batch in (1, 16):
        best: dict[tuple[str, str], float] = {}
        outputs: dict[tuple[str, str], list[list[int]]] = {}
        for weights, impl in VARIANTS:  # warm-up
            set_experts_impl(engines[weights].engine.runner.model, impl)
            decode(engines[weights], batch, 2)
        for _ in range(a.repeats):
            for v in VARIANTS:
                set_experts_impl(engines[v[0]].engine.runner.model, v[1])
                tok_s, outputs[v] = decode(engines[v[0]], batch, a.steps)
                best[v] = max(best.get(v, 0.0), tok_s)
        base, loop = ("fp32", "grouped"), ("fp32", "per_token")
        for v in VARIANTS:
            rows.append({"batch": batch, "weights": v[0], "experts": v[1],
                         "decode_tok_s": best[v], "vs_per_token": best[v] / best[loop],
                         "vs_fp32_grouped": best[v] / best[base],
                         "same_output_as_fp32": outputs[v] == outputs[loop]})
    print(f"\nMoE decode ({model_dir.name}: {SHAPE['num_hidden_layers']} layers, hidden "
          f"{SHAPE['hidden_size']}, {SHAPE['num_local_experts']} experts top-"
          f"{SHAPE['num_experts_per_tok']}, fp32 activations, greedy, "
          f"{torch.get_num_threads()} threads)")
    print_table(rows, ["batch", "weights", "experts", "decode_tok_s", "vs_per_token",
                       "vs_fp32_grouped", "same_output_as_fp32"])
    print(f"\nwrote {write_json(a.output, {'shape': SHAPE, 'steps': a.steps, 'rows': rows})}")


if __name__ == "__main__":
    main()
