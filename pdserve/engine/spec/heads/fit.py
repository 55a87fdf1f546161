"""Fitting an EAGLE head to a target by self-distillation, and saving it in the layout the
EAGLE loader reads (`eagle.py`): what `bench/train_draft_head.py` runs on the default model
and what tests use to get heads whose drafts are really accepted.

    sequences the target generated ─► target features f_i at every position (`collect`)
    windows of (x_{i+1}, f_i) ─► head (the inference modules, causal attention per window)
        loss = smooth-L1(out_i, f_{i+1}) / std(f)          (EAGLE's feature regression)
             + ce_weight * CE(lm_head(out_i), x_{i+2})      (on a share of the positions)
        input features get uniform noise (EAGLE's robustness to its own drafted features)

The training forward runs the same modules as serving (fc, the decoder layer's projections,
rotary, norms, MLP) with plain causal attention over each window, so a fitted head needs no
conversion. CPU-sized: one head layer, a frozen LM head, Adam with a cosine decay.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from pdserve.engine.spec.heads.eagle import EagleHead

if TYPE_CHECKING:
    from pdserve.engine.engine import LLMEngine


@dataclass(frozen=True)
class Trace:
    token_ids: list[int]
    hidden: torch.Tensor  # [n, H] the target's final hidden state at every position


@dataclass(frozen=True)
class FitConfig:
    steps: int = 300
    batch: int = 8
    window: int = 64
    lr: float = 2e-3
    noise: float = 0.05
    """Half-width of the uniform noise added to input features, relative to their std."""
    ce_weight: float = 0.5
    ce_share: float = 0.25
    """Share of positions whose CE through the (frozen, possibly large) LM head is computed."""
    time_budget_s: float | None = None
    """Stop after this long even if `steps` are not done."""
    seed: int = 0


def collect(engine: LLMEngine, sequences: Sequence[Sequence[int]]) -> list[Trace]:
    """Target features of each whole sequence (prompt and what the target generated)."""
    # clone(): a tensor made in inference mode cannot be saved for backward.
    return [Trace(list(s), engine.prompt_features(s).hidden.float().cpu().clone())
            for s in sequences]


def head_config(engine: LLMEngine) -> dict:
    """A one-layer Llama config of the target's shape: the EAGLE head's config.json."""
    c = engine.model_config
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
            "head_dim": c.head_dim, "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps,
            "vocab_size": c.vocab_size, "max_position_embeddings": engine.max_model_len,
            "rope_theta": c.rope.theta, "torch_dtype": "float32"}


def new_head(engine: LLMEngine, seed: int = 0, std: float = 0.02) -> EagleHead:
    """A randomly initialised fp32 EAGLE head sharing the target's embedding and LM head."""
    from pdserve.engine.spec.heads.base import target_embedding_and_head

    embed, lm_head = target_embedding_and_head(engine)
    torch.manual_seed(seed)
    head = EagleHead(head_config(engine), torch.float32, embed.float().cpu(),
                     lm_head.float().cpu(), engine.max_model_len)
    for name, p in head.named_parameters():
        p.data = (torch.ones_like(p) if name.endswith("norm.weight")
                  else torch.randn_like(p) * std)
    return head


def train_forward(head: EagleHead, ids: torch.Tensor, positions: torch.Tensor,
                  feats: torch.Tensor) -> torch.Tensor:
    """[B, T] tokens and positions, [B, T, H] features -> [B, T, H] head outputs, causal
    within each row (a differentiable twin of the paged forward)."""
    b, t, h = feats.shape
    x = head.fc(torch.cat([F.embedding(ids, head.embed), feats], dim=-1)).view(b * t, h)
    residual = None
    for layer in head.layers:
        if residual is None:
            residual, inp = x, x
        else:
            residual = x + residual
            inp = layer.input_layernorm(residual)
        residual = _attention(layer.self_attn, positions, inp, b, t) + residual
        x = layer.mlp(layer.post_attention_layernorm(residual))
    return (x + residual).view(b, t, h)


def _attention(attn, positions: torch.Tensor, x: torch.Tensor, b: int, t: int) -> torch.Tensor:
    q, k, v = attn.project(x)
    q, k = attn.rotary(positions.reshape(-1), q, k)
    q, k, v = (z.view(b, t, z.shape[1], z.shape[2]).transpose(1, 2) for z in (q, k, v))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scale,
                                       enable_gqa=True)
    return attn.o_proj(o.transpose(1, 2).reshape(b * t, -1))


def _batch(traces: Sequence[Trace], cfg: FitConfig, g: torch.Generator):
    """Random windows: (x_{i+1}, f_i) inputs, f_{i+1} and x_{i+2} targets, positions i."""
    usable = [tr for tr in traces if len(tr.token_ids) >= cfg.window + 2]
    picks = torch.randint(len(usable), (cfg.batch,), generator=g).tolist()
    ids, pos, feats, nxt, labels = [], [], [], [], []
    for i in picks:
        tr = usable[i]
        s = int(torch.randint(len(tr.token_ids) - cfg.window - 1, (1,), generator=g))
        toks = torch.tensor(tr.token_ids[s:s + cfg.window + 2])
        ids.append(toks[1:-1])
        labels.append(toks[2:])
        pos.append(torch.arange(s, s + cfg.window))
        feats.append(tr.hidden[s:s + cfg.window])
        nxt.append(tr.hidden[s + 1:s + cfg.window + 1])
    return (torch.stack(ids), torch.stack(pos), torch.stack(feats), torch.stack(nxt),
            torch.stack(labels))


def fit(head: EagleHead, traces: Sequence[Trace], cfg: FitConfig = FitConfig(),
        log: Callable[[dict], None] | None = None) -> list[dict]:
    """Train `head` in place; returns one record per logged step."""
    g = torch.Generator().manual_seed(cfg.seed)
    params = [p for p in head.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=cfg.lr)
    std = torch.cat([tr.hidden for tr in traces]).std().item()
    t0, records = time.perf_counter(), []
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = cfg.lr * 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
        ids, pos, feats, nxt, labels = _batch(traces, cfg, g)
        noisy = feats + (torch.rand(feats.shape, generator=g) * 2 - 1) * cfg.noise * std
        out = train_forward(head, ids, pos, noisy)
        reg = F.smooth_l1_loss(out / std, nxt / std)
        pick = torch.rand(out.shape[:2], generator=g) < cfg.ce_share
        ce = F.cross_entropy(F.linear(out[pick], head.lm_head), labels[pick]) if pick.any() \
            else out.sum() * 0
        loss = reg + cfg.ce_weight * ce
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 0 or step == cfg.steps - 1:
            rec = {"step": step, "reg": reg.item(), "ce": ce.item(),
                   "s": time.perf_counter() - t0}
            records.append(rec)
            if log is not None:
                log(rec)
        if cfg.time_budget_s is not None and time.perf_counter() - t0 > cfg.time_budget_s:
            break
    for p in params:
        p.requires_grad_(False)
    return records


def save(head: EagleHead, config: dict, out_dir: str | Path) -> Path:
    """The head as an EAGLE checkpoint directory: config.json + model.safetensors with
    `fc.weight` and `layers.<i>.*` in Hugging Face names (q/k/v and gate/up unfused)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {"fc.weight": head.fc.weight.detach()}
    if head.fc.bias is not None:
        tensors["fc.bias"] = head.fc.bias.detach()
    cfg = head.cfg
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for i, layer in enumerate(head.layers):
        p = f"layers.{i}."
        qw, kw, vw = layer.self_attn.qkv_proj.weight.detach().split([q, kv, kv])
        gate, up = layer.mlp.gate_up_proj.weight.detach().chunk(2)
        tensors.update({
            p + "self_attn.q_proj.weight": qw, p + "self_attn.k_proj.weight": kw,
            p + "self_attn.v_proj.weight": vw,
            p + "self_attn.o_proj.weight": layer.self_attn.o_proj.weight.detach(),
            p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
            p + "mlp.down_proj.weight": layer.mlp.down_proj.weight.detach(),
            p + "post_attention_layernorm.weight": layer.post_attention_layernorm.weight.detach()})
        if hasattr(layer, "input_layernorm"):
            tensors[p + "input_layernorm.weight"] = layer.input_layernorm.weight.detach()
    (out / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.float().contiguous() for k, v in tensors.items()},
              out / "model.safetensors", metadata={"format": "pt"})
    return out
