"""End-to-end decode tokens/s of a ~1B random Llama on one GPU, one engine config per process.

    python bench/gpu/e2e_bench.py prepare --model DIR
    python bench/gpu/e2e_bench.py run {bf16,fp8,bf16+ngram,fp8+ngram} --model DIR --out DIR

`prepare` writes the checkpoint (bf16 safetensors): the demo model's layout at hidden 2048,
intermediate 5632, 16 layers, 16 heads / 4 KV heads, vocab 32000 (~0.85B parameters). The demo
tokenizer cannot be trained to 32000 tokens on its built-in corpus, so the checkpoint carries the
4096-token demo tokenizer and prompts are token ids (ids it lacks decode to nothing).

`run` builds `LLM(..., attention_backend="triton")` with the config's options, warms up, then
times batch 1 and batch 32 (128-token prompts, 128 greedy tokens each). Options that the engine
does not accept are reported as "n/a" with the error, not as a failure of the script.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pdserve.demo_model import build_weights, make_config, write_tokenizer_files  # noqa: E402

MODEL_SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                   num_attention_heads=16, num_key_value_heads=4, vocab_size=32000,
                   max_position_embeddings=4096)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
CONFIGS = {
    "bf16": {},
    "fp8": {"quantization": "fp8"},
    "bf16+ngram": {"speculative_config": NGRAM},
    "fp8+ngram": {"quantization": "fp8", "speculative_config": NGRAM},
}
PROMPT_LEN, NEW_TOKENS = 128, 128


def prepare(model_dir: Path) -> None:
    from safetensors.torch import save_file

    if (model_dir / "model.safetensors").exists():
        print(f"model already at {model_dir}")
        return
    t0 = time.perf_counter()
    config = make_config(**MODEL_SHAPE)
    model_dir.mkdir(parents=True, exist_ok=True)
    hf = config.to_hf_config()
    hf["torch_dtype"] = "bfloat16"
    (model_dir / "config.json").write_text(json.dumps(hf, indent=2))
    gen = {k: hf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (model_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))
    write_tokenizer_files(model_dir, vocab_size=4096)
    weights = {k: v.to(torch.bfloat16) for k, v in build_weights(config).items()}
    params = sum(v.numel() for v in weights.values())
    save_file(weights, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    print(f"wrote {params / 1e9:.2f}B-parameter model to {model_dir} "
          f"in {time.perf_counter() - t0:.1f}s")


def prompts(n: int, seed: int) -> list[list[int]]:
    """Token-id prompts: a random 16-token phrase repeated, so n-gram lookup has matches."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(3, 4096) for _ in range(16)]
        out.append((phrase * (PROMPT_LEN // 16 + 1))[:PROMPT_LEN])
    return out


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_generate(llm, batch: int, seed: int) -> dict:
    from pdserve.engine import SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    ps = prompts(batch, seed)
    _sync()
    t0 = time.perf_counter()
    outs = llm.generate(ps, params)
    _sync()
    dt = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    return {f"b{batch}_tok_s": tokens / dt, f"b{batch}_s": dt}


def run(name: str, model_dir: Path, device: str) -> dict:
    from pdserve.engine import LLM, SamplingParams

    row: dict = {"config": name}
    t0 = time.perf_counter()
    try:
        llm = LLM(str(model_dir), dtype="bfloat16", device=device, attention_backend="triton",
                  kv_cache_memory_gb=8, max_num_seqs=64, max_num_batched_tokens=4096,
                  **CONFIGS[name])
    except (TypeError, ValueError, NotImplementedError, ImportError) as e:
        row.update(status="n/a", error=f"{type(e).__name__}: {e}")
        return row
    row["load_s"] = time.perf_counter() - t0
    llm.generate(prompts(2, 0), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    row.update(timed_generate(llm, 1, 1))
    row.update(timed_generate(llm, 32, 2))
    stats = getattr(llm.engine, "stats", None)
    if stats is not None:
        row["engine_stats"] = {k: v for k, v in stats().items() if isinstance(v, int | float)}
    row["status"] = "ok"
    del llm
    gc.collect()
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=["prepare", "run"])
    ap.add_argument("config", nargs="?", choices=sorted(CONFIGS))
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    if args.cmd == "prepare":
        prepare(Path(args.model))
        return 0
    if args.config is None:
        ap.error("run needs a config name")
    try:
        row = run(args.config, Path(args.model), args.device)
    except Exception as e:
        traceback.print_exc()
        row = {"config": args.config, "status": "error", "error": f"{type(e).__name__}: {e}"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"gpu_e2e_{args.config}.json").write_text(json.dumps(row, indent=2))
    print(json.dumps(row))
    return 0 if row.get("status") in ("ok", "n/a") else 1


if __name__ == "__main__":
    sys.exit(main())
