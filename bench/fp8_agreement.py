"""FP8 (W8A8 and KV cache) against fp32 on the real default model: top-1 agreement per recipe.

    python bench/fp8_agreement.py [--threads 2] [--variants NAME ...] [--model PATH]
                                  [--output bench/results/fp8_agreement.json]

Prompts: 256 real-text prompts, the 64 passages of `bench/real_text.py` each cut after 1/4,
1/2, 3/4 and all of its tokens. Scored as vLLM scores prompts: the fp32 model's and the FP8
model's greedy top-1 at every position of every passage, in batched forward passes. A causal
model with per-token activation scales and per-row KV scales computes the same logits at the
end of a prefix whether or not the rest of the passage follows, so a prompt's first generated
token is the passage's top-1 at its cut; `--check N` re-scores N prompts on their own and
reports whether they match.

- first_token_agreement: share of the 256 prompts whose first greedy token equals fp32's;
- per_position_agreement: share of all positions of the passages (1.5k) whose top-1 does.

Rows (`VARIANTS`): every linear layer in FP8 (the scheme before issue 11), one layer type at a
time (sensitivity), all but some layers (what keeping them in fp32 buys), the shipped default
(`DEFAULT_FULL_PRECISION`), the FP8 KV cache alone and with the default, and for scale the
whole model in bf16 (weights and activations). The LM head is fp32 in every FP8 row. The last
three rows score W4A16 (`quantization="int4"`, the GGUF's own Q4_1 blocks) the same way.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import print_table, write_json  # noqa: E402
from bench.real_text import PASSAGES  # noqa: E402
from pdserve.default_model import ensure_default_model  # noqa: E402
from pdserve.engine import LLM  # noqa: E402
from pdserve.engine.quant.fp8_scheme import DEFAULT_FULL_PRECISION  # noqa: E402
from pdserve.engine.scheduler import ScheduledChunk  # noqa: E402

CUTS = (0.25, 0.5, 0.75, 1.0)
_ALL = ("*.qkv_proj", "*.o_proj", "*.gate_up_proj", "*.mlp.down_proj")


def _only(kind: str) -> tuple[str, ...]:
    return tuple(p for p in _ALL if p != kind)


VARIANTS: dict[str, dict] = {
    "w8a8 every linear": {"quantization": "fp8", "fp8_full_precision_layers": ()},
    "w8a8 default recipe": {"quantization": "fp8"},
    "kv fp8": {"kv_cache_dtype": "fp8"},
    "w8a8 default + kv fp8": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
    "w8a8 all but layer 0": {"quantization": "fp8", "fp8_full_precision_layers": ("layers.0.*",)},
    "w8a8 all but down": {"quantization": "fp8",
                          "fp8_full_precision_layers": ("*.mlp.down_proj",)},
    "w8a8 qkv only": {"quantization": "fp8", "fp8_full_precision_layers": _only("*.qkv_proj")},
    "w8a8 o only": {"quantization": "fp8", "fp8_full_precision_layers": _only("*.o_proj")},
    "w8a8 gate_up only": {"quantization": "fp8",
                          "fp8_full_precision_layers": _only("*.gate_up_proj")},
    "w8a8 down only": {"quantization": "fp8",
                       "fp8_full_precision_layers": _only("*.mlp.down_proj")},
    "w8a8 attention only": {"quantization": "fp8",
                            "fp8_full_precision_layers": ("*.gate_up_proj", "*.mlp.down_proj")},
    "bf16 model (reference)": {"dtype": "bfloat16"},
    "w4a16 int4 (fp32 head)": {"quantization": "int4", "lm_head_dtype": "model"},
    "w4a16 int4 + bf16 head": {"quantization": "int4", "lm_head_dtype": "bf16"},
    "w4a16 int4 + int8 head": {"quantization": "int4", "lm_head_dtype": "int8"},
    "w4a16 int4 torch kernel + int8 head": {"quantization": "int4", "lm_head_dtype": "int8",
                                            "int4_kernel": "cpu-torch"},
    "w4a16 int4 + int4 head": {"quantization": "int4", "lm_head_dtype": "int4"},
}


def top1_per_position(llm: LLM, prompts: list[list[int]], budget: int = 1024
                      ) -> list[torch.Tensor]:
    """Greedy top-1 at every position of each prompt, prompts batched up to `budget` tokens
    per forward pass (a standalone pass: the engine's cache and scheduler are untouched)."""
    engine, out, i = llm.engine, [], 0
    while i < len(prompts):
        group, tokens = [], 0
        while i < len(prompts) and (not group or tokens + len(prompts[i]) <= budget):
            group.append(prompts[i])
            tokens += len(prompts[i])
            i += 1
        blocks = [engine.pool.allocate(-(-len(p) // engine.config.block_size)) for p in group]
        try:
            chunks = [ScheduledChunk(f"score-{j}", list(p), 0, b, len(p))
                      for j, (p, b) in enumerate(zip(group, blocks, strict=True))]
            top1 = engine.runner.logits(chunks).argmax(-1)
        finally:
            for b in blocks:
                engine.pool.free(b)
        out += list(top1.split([len(p) for p in group]))
    return out


def cut_points(n: int) -> list[int]:
    """Last position of each prompt cut from an n-token passage."""
    return [max(1, round(n * c)) - 1 for c in CUTS]


def agreement(ref: list[torch.Tensor], got: list[torch.Tensor]) -> dict:
    first = [int(r[c] == g[c]) for r, g in zip(ref, got, strict=True)
             for c in cut_points(len(r))]
    same = torch.cat([r == g for r, g in zip(ref, got, strict=True)])
    return {"first_token_agreement": sum(first) / len(first),
            "per_position_agreement": same.float().mean().item(),
            "prompts": len(first), "positions": same.numel()}


def standalone_check(llm: LLM, passages: list[list[int]], scored: list[torch.Tensor],
                     count: int) -> bool:
    """Do `count` prompts scored on their own give the top-1 the batched passages gave?"""
    ok = True
    for p, s in list(zip(passages, scored, strict=True))[:count]:
        for c in cut_points(len(p))[:2]:
            ok &= int(llm.engine.prompt_logits(p[: c + 1])[-1].argmax()) == int(s[c])
    return ok


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--check", type=int, default=2, help="passages re-scored standalone")
    ap.add_argument("--model", default=None, help="default: the real default model")
    ap.add_argument("--output", default="bench/results/fp8_agreement.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model_dir = Path(a.model) if a.model else ensure_default_model()
    # Dense fp32 is the reference and every variant's starting point (a Q4 GGUF runs int4 else).
    opts = {"dtype": "float32", "num_gpu_blocks": 192, "enable_prefix_caching": False,
            "quantization": "none"}
    base = LLM(str(model_dir), **opts)
    passages = [base.tokenizer.encode(p) for p in PASSAGES]
    ref = top1_per_position(base, passages)
    rows = []
    for name in a.variants:
        t0 = time.perf_counter()
        llm = LLM(str(model_dir), **{**opts, **VARIANTS[name]})
        got = top1_per_position(llm, passages)
        row = {"variant": name, **agreement(ref, got), "seconds": time.perf_counter() - t0}
        if name == "w8a8 default recipe" and a.check:
            row["standalone_check"] = (standalone_check(llm, passages, got, a.check)
                                       and standalone_check(base, passages, ref, a.check))
        rows.append(row)
        print(row, flush=True)
        del llm
        write_json(a.output, {"model": model_dir.name, "rows": rows,
                              "default_full_precision": list(DEFAULT_FULL_PRECISION),
                              "load_average": os.getloadavg()[0]})
    print(f"\nTop-1 agreement with fp32, {model_dir.name}, {rows[0]['prompts']} prompts, "
          f"{rows[0]['positions']} positions, load average {os.getloadavg()[0]:.1f}")
    print_table(rows, ["variant", "first_token_agreement", "per_position_agreement"])
    print(f"\nwrote {a.output}")


if __name__ == "__main__":
    main()
