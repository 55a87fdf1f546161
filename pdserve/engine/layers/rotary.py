"""Rotary position embeddings (NeoX half-rotation layout) with default, linear, llama3 and
yarn frequency schedules, and explicit per-frequency divisors (GGUF `rope_freqs`). cos/sin are
tabulated once for every position up to the model length; yarn also scales them by its
attention factor (as transformers does), and `yarn_softmax_mscale` gives the extra softmax
scale DeepSeek's `mscale_all_dim` asks for. `at(positions)` looks up a step's rows once, and
every layer rotates with them."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from pdserve.engine.layers.fused import cpu_ops_for
from pdserve.engine.model_config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        inv = inv / rope.get("factor", 1.0)
    elif rope.rope_type == "llama3":
        inv = _llama3_schedule(inv, rope)
    elif rope.rope_type == "yarn":
        inv = _yarn_schedule(rope, head_dim)
    if rope.freq_factors:
        if len(rope.freq_factors) != head_dim // 2:
            raise ValueError(f"{len(rope.freq_factors)} rope frequency factors for a head of "
                             f"{head_dim} (expected {head_dim // 2})")
        inv = inv / torch.tensor(rope.freq_factors, dtype=torch.float32)
    return inv


def _llama3_schedule(inv: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between."""
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_len = rope.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


def _yarn_schedule(rope: RopeConfig, dim: int) -> torch.Tensor:
    """YaRN (Peng et al.): interpolate low frequencies by `factor`, keep high ones, ramp
    linearly between the dimensions that rotate `beta_slow` and `beta_fast` times over the
    original context."""
    factor = rope.get("factor", 1.0)
    old_len = rope.get("original_max_position_embeddings", 4096)
    fast, slow = rope.get("beta_fast") or 32.0, rope.get("beta_slow") or 1.0

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(fast), correction_dim(slow)
    if rope.get("truncate", 1.0):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolate = 1 - ramp
    return (1.0 / (factor * pos)) * (1 - extrapolate) + (1.0 / pos) * extrapolate


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(rope: RopeConfig) -> float:
    """What cos/sin are multiplied by (1 except for yarn)."""
    if rope.rope_type != "yarn":
        return 1.0
    given = rope.get("attention_factor")
    if given is not None:
        return given
    factor = rope.get("factor", 1.0)
    mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")
    if mscale and mscale_all:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
    return _yarn_mscale(factor)


def yarn_softmax_mscale(rope: RopeConfig) -> float:
    """DeepSeek's softmax scale multiplier: mscale(factor, mscale_all_dim)^2 under any
    scaled rope that names `mscale_all_dim`, else 1."""
    mscale_all = rope.get("mscale_all_dim")
    if rope.rope_type == "default" or not mscale_all:
        return 1.0
    return _yarn_mscale(rope.get("factor", 1.0), mscale_all) ** 2


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


@dataclass(frozen=True)
class RopeAt:
    """cos and sin rows of one step's positions, [T, 1, head_dim] in the activations' dtype."""

    cos: torch.Tensor
    sin: torch.Tensor


class RotaryEmbedding(nn.Module):
    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        inv = inverse_frequencies(rope, head_dim)
        t = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = torch.outer(t, inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = attention_factor(rope)
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        self.register_buffer("sin", emb.sin() * scale, persistent=False)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeAt:
        """The rows for `positions` [T], once per step (shared by every layer)."""
        return RopeAt(self.cos[positions].unsqueeze(1).to(dtype),
                      self.sin[positions].unsqueeze(1).to(dtype))

    def forward(self, rope: RopeAt | torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, KVH, D]; `rope`: this step's rows, or the positions [T]."""
        if not isinstance(rope, RopeAt):
            rope = self.at(rope, q.dtype)
        cos, sin = rope.cos, rope.sin
        ops = cpu_ops_for(q)
        if ops is not None and q.stride(-1) == 1 and k.stride(-1) == 1:
            return ops.rotary(q, k, cos, sin)  # bitwise the expression below, one call
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
