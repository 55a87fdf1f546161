"""Full-precision weights to `Int4Weight` at load: asymmetric, group-wise, with a clipping search.

Each group of `group_size` input features of a row gets its own range [lo, hi]:
scale = (hi - lo) / 15, offset = lo, q = round((w - lo) / scale) in [0, 15] (the Q4_1 form).
The plain min/max range spends its 16 levels on the group's extreme values; shrinking the range
a little (`lo * r`, `hi * r`) clips those few values but steps every other value more finely.
With `clip_ratios=CLIP_SEARCH` every group tries each ratio and keeps the one with the smallest
squared error over the group (llama.cpp and AWQ search ranges similarly). It lowers the weight
error, but measured on the real default model it lowered top-1 agreement with the fp model
(bench/int4_bench.py, docs/perf.md: 68.1% vs 70.3% per position), so the default is plain
min/max, the range Q4_1 uses.
"""

from __future__ import annotations

import torch

from pdserve.engine.quant.int4_weight import Int4Weight

DEFAULT_GROUP_SIZE = 128
MIN_MAX = (1.0,)
CLIP_SEARCH = (1.0, 0.95, 0.9, 0.85, 0.8)
"""Range shrink factors tried per group (1.0 = plain min/max)."""
_MIN_STEP = 1e-12  # a constant group still gets a finite step (its values are exact: q = 0)
_CHUNK_ROWS = 2048  # bounds the search's temporaries (a few MB per chunk)


def default_group_size(in_features: int, preferred: int = DEFAULT_GROUP_SIZE) -> int:
    """`preferred`, halved until it divides `in_features` (e.g. 64 for 576 features).

    Chosen from the checkpoint's full input width, never from a tensor-parallel shard, so the
    groups (and the numbers) do not depend on the TP degree.
    """
    g = preferred
    while g > 16 and in_features % g:
        g //= 2
    if in_features % g:
        raise ValueError(f"{in_features} input features have no power-of-two group of at least "
                         "16 dividing them: this layer cannot be quantised to 4 bits")
    return g


def quantize_int4(w: torch.Tensor, group_size: int | None = None,
                  clip_ratios: tuple[float, ...] = MIN_MAX) -> Int4Weight:
    """w [N, K] float -> `Int4Weight` with float32 scales and offsets."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"expected a float [N, K] weight, got {w.dtype} {list(w.shape)}")
    n, k = w.shape
    g = group_size or default_group_size(k)
    if k % g:
        raise ValueError(f"{k} input features are not a whole number of groups of {g}")
    q = torch.empty(n, k, dtype=torch.uint8, device=w.device)
    scale = torch.empty(n, k // g, dtype=torch.float32, device=w.device)
    offset = torch.empty_like(scale)
    for r0 in range(0, n, _CHUNK_ROWS):
        r1 = min(n, r0 + _CHUNK_ROWS)
        cq, cs, co = _quantize_groups(w[r0:r1].float().reshape(r1 - r0, k // g, g), clip_ratios)
        q[r0:r1], scale[r0:r1], offset[r0:r1] = cq.reshape(r1 - r0, k), cs, co
    return Int4Weight(q, scale, offset, g)


def _quantize_groups(x: torch.Tensor, ratios: tuple[float, ...]
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [R, G, g] -> (q uint8 [R, G, g], scale [R, G], offset [R, G]), best ratio per group."""
    lo, hi = x.amin(-1), x.amax(-1)
    best_err = best_q = best_step = best_low = None
    for ratio in ratios:
        low = lo * ratio
        step = ((hi * ratio - low) / 15).clamp_min(_MIN_STEP)
        q = ((x - low.unsqueeze(-1)) / step.unsqueeze(-1)).round_().clamp_(0, 15)
        err = (q * step.unsqueeze(-1) + low.unsqueeze(-1) - x).square_().sum(-1)
        if best_err is None:
            best_err, best_q, best_step, best_low = err, q, step, low
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_q = torch.where(better.unsqueeze(-1), q, best_q)
        best_step = torch.where(better, step, best_step)
        best_low = torch.where(better, low, best_low)
    return best_q.to(torch.uint8), best_step, best_low
