"""A sparse MoE feed-forward block: router, routed experts, optional shared expert.

    x ─► gate (fp32) ─► select_experts ─► FusedExperts (this rank's partial) ─┐
    └──► shared expert (TP-sliced dense MLP, no reduction) [× sigmoid gate] ──┴► + ─► all-reduce

One all-reduce per block whatever the split (tensor- or expert-parallel experts). The same
block serves Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V2/V3: the differences are
`MoEConfig` fields. Parameter names follow the checkpoints (`gate`, `experts`,
`shared_expert`, `shared_expert_gate`); `expert_param_target` maps the per-expert tensors.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.layers.fused import silu_mul
from pdserve.engine.layers.linear import Loaded, MergedColumnParallelLinear, RowParallelLinear
from pdserve.engine.layers.moe import FusedExperts
from pdserve.engine.layers.router import select_experts
from pdserve.engine.moe_config import MoEConfig
from pdserve.engine.parallel import SINGLE, ParallelContext
from pdserve.engine.quant.int4_weight import Int4Weight

_EXPERT_TENSOR = re.compile(r"^(?P<prefix>(?:.*\.)?experts)\.(?P<e>\d+)\.(?P<part>\w+)\."
                            r"(?P<kind>weight|weight_scale)$")
# Mixtral's names and the Qwen / DeepSeek names of the same three matrices.
_EXPERT_PARTS = {"w1": "w1", "gate_proj": "w1", "w3": "w3", "up_proj": "w3",
                 "w2": "w2", "down_proj": "w2"}


def expert_param_target(name: str) -> tuple[str, tuple[int, str]] | None:
    """`...experts.<e>.<w1|gate_proj|...>.weight[_scale]` -> (our stacked parameter,
    (e, "w1" | "w3" | "w2")); None for any other tensor."""
    m = _EXPERT_TENSOR.match(name)
    if m is None or m["part"] not in _EXPERT_PARTS:
        return None
    part = _EXPERT_PARTS[m["part"]]
    stack = "w2" if part == "w2" else "w13"
    suffix = "weight" if m["kind"] == "weight" else "scale"
    return f"{m['prefix']}.{stack}_{suffix}", (int(m["e"]), part)


class GateLinear(nn.Module):
    """A small replicated projection kept in fp32 (the router, the shared expert's gate):
    not a `LinearBase`, so quantisation leaves it alone."""

    def __init__(self, in_features: int, out_features: int, correction_bias: bool = False
                 ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float32),
                                   requires_grad=False)
        # DeepSeek-V3's load-balancing bias: picks experts, never weighs them.
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(out_features, dtype=torch.float32), requires_grad=False)
            if correction_bias else None)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id=None) -> None:
        if isinstance(loaded, Int4Weight):
            raise ValueError("the checkpoint holds a 4-bit router (or shared-expert gate): "
                             "not supported, these stay fp32 (a routing flip costs more than "
                             "their bytes save)")
        if tuple(loaded.shape) != tuple(param.shape):
            raise ValueError(f"router tensor of shape {list(loaded.shape)}, expected "
                             f"{list(param.shape)}")
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)


class _PartialRowParallelLinear(RowParallelLinear):
    """Row-parallel without its own all-reduce: the block reduces routed + shared at once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, None)


class SharedExpert(nn.Module):
    """A dense SwiGLU MLP sliced over TP whose output is this rank's partial sum."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype,
                 tp: ParallelContext) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2, False,
                                                       dtype, tp)
        self.down_proj = _PartialRowParallelLinear(intermediate, hidden, False, dtype, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    def __init__(self, moe: MoEConfig, hidden: int, dtype: torch.dtype = torch.float32,
                 tp: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.routing = moe.routing
        self.gate = GateLinear(hidden, moe.num_experts, moe.routing.has_correction_bias)
        self.experts = FusedExperts(moe.num_experts, hidden, moe.intermediate_size, dtype, tp)
        self.shared_expert = (SharedExpert(hidden, moe.shared_intermediate_size, dtype, tp)
                              if moe.shared_intermediate_size else None)
        self.shared_expert_gate = GateLinear(hidden, 1) if moe.shared_expert_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.gate(x), self.routing,
                                      self.gate.e_score_correction_bias)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)).to(x.dtype) * shared
            out = out + shared
        return self.tp.all_reduce(out)
