"""Routed experts of an MoE block: stacked weights per rank and two ways to run them.

This rank's experts are stored as two stacked matrices (the `nn.Linear` layout per expert):
`w13_weight` [E_local, 2 * I_local, H] (gate rows, then up rows) and `w2_weight`
[E_local, H, I_local]. How they are split over the tensor-parallel group:

- tensor parallel (default): every rank holds every expert, each expert's intermediate
  dimension sliced like a dense MLP (gate/up column-parallel, down row-parallel);
- expert parallel (`ParallelContext.expert_parallel`): rank r holds experts
  [r * E / size, (r + 1) * E / size) whole, and skips tokens' choices of other ranks' experts.

Either way a rank's output is a partial sum over the group: the MoE block adds its shared
expert's partial and all-reduces once.

`forward` runs the grouped path: the (token, choice) pairs are sorted by expert and each
expert runs once per step over all of its tokens. `run_per_token` is the per-token loop
(the reference the grouped path is tested and benchmarked against). The matmuls go through
`self.method` (an `ExpertsMethod`), so FP8 and W4A16 swap only the method, like
`LinearMethod`; loading does too (`weight_loader` works out this rank's `Shard` of each
expert matrix, the method decides how it is stored).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.layers.fused import silu_mul
from pdserve.engine.layers.linear import Loaded, Shard
from pdserve.engine.parallel import SINGLE, ParallelContext
from pdserve.engine.quant.int4_weight import Int4Weight

IMPLS = ("grouped", "per_token")


class ExpertsMethod:
    """How experts store and multiply their weights: plain stacked weights here; quantisation
    overrides this. `prepare` runs once before loading, `load` receives each expert matrix
    (or FP8 scale column) with this rank's `Shard` of it, `finalize` once after loading."""

    def prepare(self, layer: FusedExperts) -> None:
        """Called once before loading (give the layer the parameters this scheme loads)."""

    def load(self, layer: FusedExperts, param: nn.Parameter, local: int, part: str,
             loaded: Loaded, shard: Shard | None) -> None:
        """Expert `local`'s `part` ("w1" gate, "w3" up, "w2" down) into its slot of `param`."""
        piece = loaded if shard is None else shard.take(loaded)
        if isinstance(piece, Int4Weight):  # a 4-bit checkpoint loaded into a dense model
            piece = piece.dequantize(param.dtype)
        dst = param.data[local]
        dest_row = 0 if shard is None else shard.dest_row
        dst.narrow(0, dest_row, piece.shape[0]).copy_(piece)

    def gate_up(self, layer: FusedExperts, expert: int, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.w13_weight[expert])

    def down(self, layer: FusedExperts, expert: int, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, layer.w2_weight[expert])

    def finalize(self, layer: FusedExperts) -> None:
        """Called once after all weights are loaded (quantise, repack, ...)."""


class FusedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int,
                 dtype: torch.dtype = torch.float32, tp: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.num_experts = num_experts
        if tp.expert_parallel:
            if num_experts % tp.size:
                raise ValueError(f"{num_experts} experts do not split over {tp.size} "
                                 "expert-parallel ranks")
            self.num_local = num_experts // tp.size
            self.expert_start = tp.rank * self.num_local
            self.intermediate = intermediate
        else:
            if intermediate % tp.size:
                raise ValueError(f"expert intermediate size {intermediate} does not split "
                                 f"over TP={tp.size}")
            self.num_local, self.expert_start = num_experts, 0
            self.intermediate = intermediate // tp.size
        self.hidden = hidden
        self.w13_weight = nn.Parameter(
            torch.empty(self.num_local, 2 * self.intermediate, hidden, dtype=dtype),
            requires_grad=False)
        self.w2_weight = nn.Parameter(
            torch.empty(self.num_local, hidden, self.intermediate, dtype=dtype),
            requires_grad=False)
        self.method = ExpertsMethod()
        self.impl = "grouped"
        """"grouped" or "per_token" (the reference; benchmarks switch it on a loaded model)."""
        self._loaded: set[tuple[int, int, str]] = set()  # (id(param), local expert, part)

    # -- loading ---------------------------------------------------------------------------
    def weight_loader(self, param: nn.Parameter, loaded: Loaded,
                      shard_id: tuple[int, str]) -> None:
        """Hand expert `e`'s `part` ("w1" gate, "w3" up, "w2" down) to the method with this
        rank's slice of it: a matrix [N, K] (dense or `Int4Weight`) or, for FP8 checkpoints,
        its [N, 1] scale column."""
        expert, part = shard_id
        local = expert - self.expert_start
        if not 0 <= expert < self.num_experts or part not in ("w1", "w2", "w3"):
            raise ValueError(f"expert weight {shard_id} outside {self.num_experts} experts")
        if not 0 <= local < self.num_local:
            return  # another expert-parallel rank owns it
        rows = self.intermediate
        if part != "w2":  # gate rows, then up rows, each this rank's slice
            shard = Shard(0, self._shard_offset(), rows, dest_row=0 if part == "w1" else rows)
        elif param is self.w2_weight:  # a scale column has every output row, unsplit
            shard = Shard(1, self._shard_offset(), rows)
        else:
            shard = None
        self.method.load(self, param, local, part, loaded, shard)
        self._loaded.add((id(param), local, part))

    def _shard_offset(self) -> int:
        return 0 if self.tp.expert_parallel else self.tp.rank * self.intermediate

    def check_loaded(self, prefix: str) -> None:
        """Raise if any of this rank's experts missed a matrix (or a scale) in the checkpoint;
        `prefix` is this module's name in the model."""
        for name, param in self.named_parameters():
            parts = ("w1", "w3") if name.startswith("w13") else ("w2",)
            for local in range(self.num_local):
                for part in parts:
                    if (id(param), local, part) not in self._loaded:
                        raise ValueError(f"checkpoint is missing {prefix}."
                                         f"{local + self.expert_start}.{part} ({name})")
        self._loaded.clear()

    # -- running ---------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
                ) -> torch.Tensor:
        """x [T, H], routing weights / global expert ids [T, k] -> this rank's partial [T, H]."""
        if self.impl == "per_token":
            return run_per_token(self, x, weights, ids)
        return run_grouped(self, x, weights, ids)

    def expert_mlp(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """One local expert's SwiGLU MLP over rows x [n, H]."""
        return self.method.down(self, expert, silu_mul(self.method.gate_up(self, expert, x)))


def run_grouped(layer: FusedExperts, x: torch.Tensor, weights: torch.Tensor,
                ids: torch.Tensor) -> torch.Tensor:
    """Sort the (token, choice) pairs by expert; run each local expert once over its rows."""
    out = torch.zeros_like(x)
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=layer.num_experts).tolist()  # one host sync
    flat_weights = weights.reshape(-1)
    start = sum(counts[:layer.expert_start])
    for local in range(layer.num_local):
        n = counts[layer.expert_start + local]
        if n == 0:
            continue
        pairs = order[start:start + n]
        start += n
        tokens = pairs // k
        y = layer.expert_mlp(local, x[tokens])
        out.index_add_(0, tokens, (y * flat_weights[pairs].unsqueeze(1)).to(out.dtype))
    return out


def run_per_token(layer: FusedExperts, x: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor) -> torch.Tensor:
    """The reference: every token runs each of its chosen experts on its own row."""
    out = torch.zeros_like(x)
    for t, (row_ids, row_weights) in enumerate(zip(ids.tolist(), weights, strict=True)):
        for j, expert in enumerate(row_ids):
            local = expert - layer.expert_start
            if 0 <= local < layer.num_local:
                y = layer.expert_mlp(local, x[t:t + 1])
                out[t] += (y[0] * row_weights[j]).to(out.dtype)
    return out
