"""Tiny random Hugging Face checkpoints saved with `transformers` (the parity reference)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pdserve.demo_model import write_tokenizer_files

VOCAB = 512

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
               bos_token_id=1, eos_token_id=2)


def _config(family: str, **overrides):
    import transformers

    kwargs = dict(_COMMON, **overrides)
    if family == "llama":
        return transformers.LlamaConfig(**kwargs)
    if family == "qwen2":
        kwargs.setdefault("tie_word_embeddings", True)
        return transformers.Qwen2Config(**kwargs)
    if family == "mistral":
        kwargs.setdefault("sliding_window", 48)
        return transformers.MistralConfig(**kwargs)
    if family == "qwen3":
        kwargs.setdefault("head_dim", 32)  # explicit, and not hidden / heads
        return transformers.Qwen3Config(**kwargs)
    return _moe_config(family, kwargs)


# MLA sizes: a 32-wide latent plus an 8-wide rope key per token (40 elements, FP8-aligned)
# against 2 * 2 heads * 16 = 64 for the GQA checkpoints; layer 0 dense, layer 1 MoE.
_MLA = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            n_shared_experts=1, first_k_dense_replace=1)


def _deepseek_config(family: str, kwargs: dict):
    """DeepSeek-V2 (V2-Lite shape: no q bottleneck; group-limited routing) and V3 (q
    bottleneck, noaux_tc routing with its bias, yarn rope with both mscales)."""
    import transformers

    kwargs = {**_MLA, **kwargs}
    kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]  # MLA: every head its own
    if family == "deepseek_v2":
        kwargs.setdefault("q_lora_rank", None)
        kwargs.setdefault("topk_method", "group_limited_greedy")
        kwargs.setdefault("n_group", 2)
        kwargs.setdefault("topk_group", 1)
        return transformers.DeepseekV2Config(**kwargs)
    kwargs.setdefault("q_lora_rank", 24)
    kwargs.setdefault("n_group", 2)
    kwargs.setdefault("topk_group", 1)
    kwargs.setdefault("rope_parameters", {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1,
        "mscale": 0.8, "mscale_all_dim": 0.7})
    return transformers.DeepseekV3Config(**kwargs)


def _moe_config(family: str, kwargs: dict):
    """Tiny MoE configs: 4 experts, top-2, hidden 64 (the `_COMMON` sizes)."""
    import transformers

    if family.startswith("deepseek"):
        return _deepseek_config(family, kwargs)
    kwargs.setdefault("num_experts_per_tok", 2)
    if family == "mixtral":
        kwargs.setdefault("num_local_experts", 4)
        return transformers.MixtralConfig(**kwargs)
    kwargs.setdefault("num_experts", 4)
    kwargs.setdefault("moe_intermediate_size", 32)
    if family == "qwen2_moe":  # shared expert with its gate; layer 1 keeps a dense MLP
        kwargs.setdefault("shared_expert_intermediate_size", 64)
        kwargs.setdefault("mlp_only_layers", [1])
        return transformers.Qwen2MoeConfig(**kwargs)
    if family == "qwen3_moe":
        kwargs.setdefault("norm_topk_prob", True)
        kwargs.setdefault("head_dim", 32)
        return transformers.Qwen3MoeConfig(**kwargs)
    raise ValueError(family)


def save_tiny(out_dir: Path, family: str, seed: int = 0, dtype=torch.float32,
              max_shard_size: str | None = None, **overrides) -> Path:
    """Build a random model of `family`, save it (optionally sharded) with a tokenizer."""
    import transformers

    torch.manual_seed(seed)
    cfg = _config(family, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)
    with torch.no_grad():  # random biases so the bias path is actually exercised
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.02)
        for name, b in model.named_buffers():  # DeepSeek-V3's routing bias picks experts
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    out_dir.mkdir(parents=True, exist_ok=True)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **kw)
    write_tokenizer_files(out_dir, vocab_size=VOCAB)
    return out_dir


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuation of each prompt with HF transformers, one prompt at a time."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                 eos_token_id=None, pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    return outs


def hf_logits(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()


def make_bigram(model_dir: Path, push: float = 4.0, seed: int = 0) -> None:
    """Turn layer 0's MLP into a lookup: token x pushes the hidden state towards the LM-head
    row of a successor token succ[x] (a random permutation).

    A random-init model's logits are nearly tied (the median top-1 margin is ~0.2 standard
    deviations), so any perturbation flips many argmaxes and agreement measures luck. Here,
    as in a trained LM, most positions have a clear winner, and that winner is decided by
    quantised layers: if quantisation broke them the argmax would no longer be the successor.
    """
    path = model_dir / "model.safetensors"
    w = load_file(str(path))
    emb, head = w["model.embed_tokens.weight"], w["lm_head.weight"]
    vocab = emb.shape[0]
    assert w["model.layers.0.mlp.gate_proj.weight"].shape[0] == vocab  # one neuron per token
    succ = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
    unit = emb / emb.norm(dim=1, keepdim=True)
    # gate = up = 0.5 * (unit embedding): neuron x fires ~silu(8) * 8 = 64 for token x, ~0 else.
    w["model.layers.0.mlp.gate_proj.weight"] = 0.5 * unit
    w["model.layers.0.mlp.up_proj.weight"] = 0.5 * unit
    head_unit = head / head.norm(dim=1, keepdim=True)
    w["model.layers.0.mlp.down_proj.weight"] = (push / 64) * head_unit[succ].t().contiguous()
    save_file(w, str(path), metadata={"format": "pt"})
    (model_dir / "successors.json").write_text(json.dumps(succ.tolist()))


_EXPERT_NAMES = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
                 "qwen2_moe": ("mlp", "gate_proj", "up_proj", "down_proj")}


def make_bigram_experts(model_dir: Path, family: str, experts: int, push: float = 4.0,
                        seed: int = 0) -> None:
    """`make_bigram` for an MoE checkpoint: every layer-0 routed expert becomes the same
    lookup (so whichever experts a token picks, token x pushes towards the LM-head row of
    succ[x]); needs the expert width to equal the vocabulary."""
    block, gate, up, down = _EXPERT_NAMES[family]
    path = model_dir / "model.safetensors"
    w = load_file(str(path))
    emb, head = w["model.embed_tokens.weight"], w["lm_head.weight"]
    succ = torch.randperm(emb.shape[0], generator=torch.Generator().manual_seed(seed))
    unit = emb / emb.norm(dim=1, keepdim=True)
    head_unit = head / head.norm(dim=1, keepdim=True)
    for e in range(experts):
        prefix = f"model.layers.0.{block}.experts.{e}."
        assert w[prefix + f"{gate}.weight"].shape[0] == emb.shape[0]  # one neuron per token
        w[prefix + f"{gate}.weight"], w[prefix + f"{up}.weight"] = 0.5 * unit, 0.5 * unit
        w[prefix + f"{down}.weight"] = (push / 64) * head_unit[succ].t().contiguous()
    save_file(w, str(path), metadata={"format": "pt"})
    (model_dir / "successors.json").write_text(json.dumps(succ.tolist()))
