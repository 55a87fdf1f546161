"""Random learned-drafter checkpoints in the layouts vLLM loads: EAGLE, EAGLE-3 (with a reduced
draft vocabulary) and Medusa head directories for a tiny Llama target, and a DeepSeek-V3
checkpoint carrying one MTP layer."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.helpers.checkpoints import save_tiny


def _target(target: Path) -> dict:
    return json.loads((target / "config.json").read_text())


def _llama_head_config(t: dict, **extra) -> dict:
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "rms_norm_eps", "vocab_size", "max_position_embeddings", "rope_parameters",
            "rope_theta", "head_dim")
    return {**{k: t[k] for k in keys if k in t}, "num_hidden_layers": 1, **extra}


def _layer(g, prefix: str, h: int, heads: int, kv: int, hd: int, inter: int, attn_in: int,
           std: float, input_norm: bool) -> dict[str, torch.Tensor]:
    def w(*shape):
        return torch.randn(*shape, generator=g) * std

    out = {f"{prefix}self_attn.q_proj.weight": w(heads * hd, attn_in),
           f"{prefix}self_attn.k_proj.weight": w(kv * hd, attn_in),
           f"{prefix}self_attn.v_proj.weight": w(kv * hd, attn_in),
           f"{prefix}self_attn.o_proj.weight": w(h, heads * hd),
           f"{prefix}mlp.gate_proj.weight": w(inter, h), f"{prefix}mlp.up_proj.weight": w(inter, h),
           f"{prefix}mlp.down_proj.weight": w(h, inter),
           f"{prefix}post_attention_layernorm.weight": 1 + w(h)}
    if input_norm:
        out[f"{prefix}input_layernorm.weight"] = 1 + w(h)
    return out


def _dims(t: dict) -> tuple[int, int, int, int, int]:
    h, heads = t["hidden_size"], t["num_attention_heads"]
    return (h, heads, t.get("num_key_value_heads") or heads, t.get("head_dim") or h // heads,
            t["intermediate_size"])


def save_eagle(out: Path, target: Path, seed: int = 0, std: float = 0.1) -> Path:
    """EAGLE: fc [H, 2H] + one decoder layer without an input norm (`layers.0.*`)."""
    t, g = _target(target), torch.Generator().manual_seed(seed)
    h, heads, kv, hd, inter = _dims(t)
    weights = {"fc.weight": torch.randn(h, 2 * h, generator=g) * std,
               **_layer(g, "layers.0.", h, heads, kv, hd, inter, h, std, input_norm=False)}
    return _write(out, _llama_head_config(t, architectures=["LlamaForCausalLM"]), weights)


def save_eagle3(out: Path, target: Path, seed: int = 0, std: float = 0.1,
                draft_vocab: int = 256, aux_layers=(0, 1, 1)) -> Path:
    """EAGLE-3: fc [H, 3H], `midlayer.*` attending over [embedding, feature], its own norm
    and LM head over `draft_vocab` target ids (d2t)."""
    t, g = _target(target), torch.Generator().manual_seed(seed)
    h, heads, kv, hd, inter = _dims(t)
    ids = torch.randperm(t["vocab_size"], generator=g)[:draft_vocab].sort().values
    weights = {"fc.weight": torch.randn(h, 3 * h, generator=g) * std,
               **_layer(g, "midlayer.", h, heads, kv, hd, inter, 2 * h, std, input_norm=True),
               "midlayer.hidden_norm.weight": torch.ones(h), "norm.weight": torch.ones(h),
               "lm_head.weight": torch.randn(draft_vocab, h, generator=g) * std,
               "d2t": ids - torch.arange(draft_vocab), "t2d": torch.zeros(t["vocab_size"],
                                                                         dtype=torch.bool)}
    cfg = _llama_head_config(t, architectures=["LlamaForCausalLMEagle3"],
                             draft_vocab_size=draft_vocab, target_hidden_size=h,
                             eagle_config={"eagle_aux_hidden_state_layer_ids": list(aux_layers)})
    return _write(out, cfg, weights)


def save_medusa(out: Path, target: Path, seed: int = 0, std: float = 0.1,
                num_heads: int = 3) -> Path:
    t, g = _target(target), torch.Generator().manual_seed(seed)
    h, v = t["hidden_size"], t["vocab_size"]
    weights = {}
    for i in range(num_heads):
        weights[f"medusa_heads.blocks.{i}.layers.0.weight"] = torch.randn(h, h, generator=g) * std
        weights[f"medusa_heads.blocks.{i}.layers.0.bias"] = torch.randn(h, generator=g) * std
        weights[f"medusa_heads.lm_heads.{i}.weight"] = torch.randn(v, h, generator=g) * std
    cfg = {"architectures": ["MedusaModel"], "hidden_size": h, "vocab_size": v,
           "num_heads": num_heads, "num_hidden_layers": 1, "medusa_fc_bias": True}
    return _write(out, cfg, weights)


def save_deepseek_v3_with_mtp(out: Path, seed: int = 0, **overrides) -> Path:
    """A 2-layer DeepSeek-V3 whose checkpoint also carries MTP layer 2 (an MoE decoder layer,
    its norms, eh_proj and shared head), as released V3 checkpoints carry layer 61."""
    save_tiny(out, "deepseek_v3", seed=seed, num_hidden_layers=3, initializer_range=0.2,
              **overrides)
    cfg = json.loads((out / "config.json").read_text())
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    cfg.update(num_hidden_layers=2, num_nextn_predict_layers=1)
    (out / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(seed + 1)
    weights = load_file(out / "model.safetensors")
    mtp = "model.layers.2."
    weights.update({f"{mtp}enorm.weight": torch.ones(h), f"{mtp}hnorm.weight": torch.ones(h),
                    f"{mtp}eh_proj.weight": torch.randn(h, 2 * h, generator=g) * 0.2,
                    f"{mtp}shared_head.norm.weight": torch.ones(h),
                    f"{mtp}shared_head.head.weight": torch.randn(v, h, generator=g) * 0.2})
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


FIT_PROMPT_LENGTHS = (20, 30, 25, 40, 12, 33, 28, 19)
FIT_TOKENS = 60


def fit_prompts(vocab: int) -> list[list[int]]:
    from tests.helpers.engine import random_prompts

    return random_prompts(FIT_PROMPT_LENGTHS, vocab, seed=21)


def fit_eagle(target: Path, out: Path, steps: int = 80) -> Path:
    """An EAGLE head fitted to `target`'s greedy continuations of `fit_prompts`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: a second thread only contends on a busy machine
    try:
        return _fit_eagle(target, out, steps)
    finally:
        torch.set_num_threads(threads)


def _fit_eagle(target: Path, out: Path, steps: int) -> Path:
    from pdserve.engine import LLM, SamplingParams
    from pdserve.engine.spec.heads import fit

    llm = LLM(str(target), dtype="float32", num_gpu_blocks=256)
    prompts = fit_prompts(llm.engine.vocab_size)
    greedy = SamplingParams(max_tokens=FIT_TOKENS, temperature=0.0, ignore_eos=True)
    seqs = [p + o.token_ids for p, o in zip(prompts, llm.generate(prompts, greedy),
                                            strict=True)]
    head = fit.new_head(llm.engine)
    fit.fit(head, fit.collect(llm.engine, seqs),
            fit.FitConfig(steps=steps, batch=8, window=32, lr=5e-3))
    return fit.save(head, fit.head_config(llm.engine), out)


def _write(out: Path, cfg: dict, weights: dict[str, torch.Tensor]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in weights.items()}, out / "model.safetensors",
              metadata={"format": "pt"})
    return out
