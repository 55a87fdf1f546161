"""Mixture-of-experts architecture numbers, read from a Hugging Face `config.json`.

`ModelConfig.moe` holds one `MoEConfig` for Mixtral, Qwen2-MoE and Qwen3-MoE (and, for the
DeepSeek MoE block, `moe_config_from_dict("deepseek_v2" | "deepseek_v3", ...)`); dense models
have none. Every family spells the same numbers differently; this module is the only place
that knows the spellings, so layers read typed fields and never a raw dict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SCORING = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True)
class RoutingConfig:
    """How a token picks its experts and weighs them (`pdserve.engine.layers.router`)."""

    top_k: int
    """Experts per token."""
    scoring: str = "softmax"
    """softmax over all experts (Mixtral, Qwen, DeepSeek-V2) or sigmoid (DeepSeek-V3)."""
    method: str = "greedy"
    """greedy: top-k of the scores; group_limited_greedy (DeepSeek-V2): only experts of the
    `topk_groups` groups with the highest best score; noaux_tc (DeepSeek-V3): scores plus the
    router's learned correction bias choose, groups ranked by their two best biased scores,
    and the unbiased scores weigh."""
    renormalize: bool = False
    """Divide the chosen weights by their sum (Mixtral always; `norm_topk_prob` elsewhere)."""
    num_groups: int = 1
    """Expert groups (`n_group`) for the group-limited methods."""
    topk_groups: int = 1
    """Groups a token may pick experts from (`topk_group`)."""
    scaling_factor: float = 1.0
    """`routed_scaling_factor`: multiplies the chosen weights (after renormalising)."""

    def __post_init__(self) -> None:
        if self.scoring not in SCORING:
            raise ValueError(f"MoE scoring function must be one of {SCORING}, got "
                             f"{self.scoring!r}")
        if self.method not in TOPK_METHODS:
            raise ValueError(f"MoE topk_method must be one of {TOPK_METHODS}, got "
                             f"{self.method!r}")
        if self.top_k < 1:
            raise ValueError(f"num_experts_per_tok must be >= 1, got {self.top_k}")
        if not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(f"topk_group {self.topk_groups} must be in [1, n_group="
                             f"{self.num_groups}]")

    @property
    def has_correction_bias(self) -> bool:
        """The router carries `e_score_correction_bias` (a checkpoint tensor)."""
        return self.method == "noaux_tc"


@dataclass(frozen=True)
class MoEConfig:
    """The sparse feed-forward blocks of a model."""

    num_experts: int
    """Routed experts per MoE block."""
    intermediate_size: int
    """Each routed expert's hidden width."""
    routing: RoutingConfig
    sparse_layers: tuple[int, ...]
    """Indices of the decoder layers whose MLP is an MoE block (the others are dense)."""
    shared_intermediate_size: int = 0
    """Width of the shared expert every token also runs (0: none)."""
    shared_expert_gate: bool = False
    """Qwen2-MoE: the shared expert's output is scaled by sigmoid(x . w_gate) per token."""

    def __post_init__(self) -> None:
        if self.num_experts < self.routing.top_k:
            raise ValueError(f"{self.num_experts} experts cannot give {self.routing.top_k} "
                             "per token")
        if self.num_experts % self.routing.num_groups:
            raise ValueError(f"{self.num_experts} experts do not form n_group="
                             f"{self.routing.num_groups} equal groups")

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers

    def check_split(self, size: int, expert_parallel: bool) -> None:
        """Refuse a parallel degree the experts cannot be split over (before any process
        starts): whole experts per rank under expert parallelism, else a slice of each."""
        if expert_parallel and self.num_experts % size:
            raise ValueError(f"{self.num_experts} experts do not split over {size} "
                             "expert-parallel ranks")
        if not expert_parallel and self.intermediate_size % size:
            raise ValueError(f"expert intermediate size {self.intermediate_size} does not "
                             f"split over TP={size}")
        if self.shared_intermediate_size % size:
            raise ValueError(f"shared expert intermediate size {self.shared_intermediate_size}"
                             f" does not split over TP={size}")


def moe_config_from_dict(family: str, cfg: dict[str, Any]) -> MoEConfig | None:
    """The MoE numbers of a `config.json` of `family`; None for a dense family."""
    reader = _READERS.get(family)
    if reader is None:
        return None
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"MoE hidden_act {cfg.get('hidden_act')!r} is not supported "
                         "(only silu)")
    return reader(cfg)


def _mixtral(cfg: dict[str, Any]) -> MoEConfig:
    return MoEConfig(
        num_experts=int(cfg["num_local_experts"]),
        intermediate_size=int(cfg["intermediate_size"]),
        routing=RoutingConfig(top_k=int(cfg["num_experts_per_tok"]), renormalize=True),
        sparse_layers=tuple(range(int(cfg["num_hidden_layers"]))))


def _qwen_moe(cfg: dict[str, Any]) -> MoEConfig:
    # transformers>=5 writes Qwen3-MoE's count as num_local_experts, released checkpoints
    # as num_experts.
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    step = int(cfg.get("decoder_sparse_step", 1))
    dense = set(cfg.get("mlp_only_layers") or [])
    sparse = tuple(i for i in range(int(cfg["num_hidden_layers"]))
                   if i not in dense and experts > 0 and (i + 1) % step == 0)
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    return MoEConfig(
        num_experts=experts, intermediate_size=int(cfg["moe_intermediate_size"]),
        routing=RoutingConfig(top_k=int(cfg["num_experts_per_tok"]),
                              renormalize=bool(cfg.get("norm_topk_prob", False))),
        sparse_layers=sparse, shared_intermediate_size=shared, shared_expert_gate=shared > 0)


def _deepseek(cfg: dict[str, Any], version: int) -> MoEConfig:
    v3 = version == 3
    method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    scoring = cfg.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    renormalize = bool(cfg.get("norm_topk_prob", v3))
    if not v3 and renormalize:
        # DeepSeek's own V2 code renormalises *instead of* scaling, transformers' V2 router
        # ignores the flag; no released V2 checkpoint sets it, so we refuse to guess.
        raise ValueError("DeepSeek-V2 with norm_topk_prob=true is not supported")
    if v3 and (method, scoring) != ("noaux_tc", "sigmoid"):
        raise ValueError(f"DeepSeek-V3 routing must be noaux_tc over sigmoid scores, got "
                         f"{method!r} over {scoring!r}")
    if not v3 and (method == "noaux_tc" or scoring != "softmax"):
        raise ValueError(f"DeepSeek-V2 routing is greedy or group_limited_greedy over softmax "
                         f"scores, got {method!r} over {scoring!r}")
    first_dense = int(cfg.get("first_k_dense_replace", 0))
    freq = int(cfg.get("moe_layer_freq", 1))
    sparse = tuple(i for i in range(int(cfg["num_hidden_layers"]))
                   if i >= first_dense and i % freq == 0)
    expert_size = int(cfg["moe_intermediate_size"])
    return MoEConfig(
        num_experts=int(cfg["n_routed_experts"]), intermediate_size=expert_size,
        routing=RoutingConfig(top_k=int(cfg["num_experts_per_tok"]), scoring=scoring,
                              method=method, renormalize=renormalize,
                              num_groups=int(cfg.get("n_group") or 1),
                              topk_groups=int(cfg.get("topk_group") or 1),
                              scaling_factor=float(cfg.get("routed_scaling_factor", 1.0))),
        sparse_layers=sparse,
        shared_intermediate_size=expert_size * int(cfg.get("n_shared_experts") or 0))


_READERS = {
    "mixtral": _mixtral,
    "qwen2_moe": _qwen_moe,
    "qwen3_moe": _qwen_moe,
    "deepseek_v2": lambda cfg: _deepseek(cfg, 2),
    "deepseek_v3": lambda cfg: _deepseek(cfg, 3),
}
