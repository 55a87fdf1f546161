"""Top-k expert routing as pure functions: router logits in, (weights, expert ids) out.

Every method computes in fp32 whatever the model dtype (the choice of expert is discrete, so
a rounding flip would change which weights run). The order of the k experts per token is the
order `torch.topk` returns; the experts layer does not depend on it.
"""

from __future__ import annotations

import torch

from pdserve.engine.moe_config import RoutingConfig


def select_experts(logits: torch.Tensor, routing: RoutingConfig,
                   correction_bias: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] fp32, expert ids [T, k] int64)."""
    logits = logits.float()
    scores = logits.softmax(dim=-1) if routing.scoring == "softmax" else logits.sigmoid()
    if routing.method == "noaux_tc":
        if correction_bias is None:
            raise ValueError("noaux_tc routing needs the router's e_score_correction_bias")
        weights, ids = _noaux_tc(scores, correction_bias.float(), routing)
    elif routing.method == "group_limited_greedy":
        weights, ids = _group_limited(scores, routing)
    else:
        weights, ids = torch.topk(scores, routing.top_k, dim=-1)
    if routing.renormalize:
        # The epsilon only matters for sigmoid scores (softmax top-k weights are never all 0).
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if routing.scaling_factor != 1.0:
        weights = weights * routing.scaling_factor
    return weights, ids


def _group_mask(group_scores: torch.Tensor, routing: RoutingConfig,
                experts: int) -> torch.Tensor:
    """[T, G] per-group scores -> [T, E] True for experts of the `topk_groups` best groups."""
    best = torch.topk(group_scores, routing.topk_groups, dim=-1).indices
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return mask.repeat_interleave(experts // routing.num_groups, dim=1)


def _group_limited(scores: torch.Tensor, routing: RoutingConfig
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2: groups ranked by their best expert; others' scores zeroed, then top-k."""
    t, experts = scores.shape
    group_scores = scores.view(t, routing.num_groups, -1).amax(dim=-1)
    keep = _group_mask(group_scores, routing, experts)
    return torch.topk(scores.masked_fill(~keep, 0.0), routing.top_k, dim=-1)


def _noaux_tc(scores: torch.Tensor, bias: torch.Tensor, routing: RoutingConfig
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3: the bias (load balancing) decides which experts, never how much."""
    t, experts = scores.shape
    biased = scores + bias
    per_group = biased.view(t, routing.num_groups, -1)
    group_scores = per_group.topk(min(2, per_group.shape[-1]), dim=-1).values.sum(dim=-1)
    keep = _group_mask(group_scores, routing, experts)
    ids = torch.topk(biased.masked_fill(~keep, float("-inf")), routing.top_k, dim=-1).indices
    return scores.gather(1, ids), ids
