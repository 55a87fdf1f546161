"""MoE building blocks without an engine: routing, the grouped experts path against the
per-token loop, TP / expert-parallel slices, DeepSeek-V2/V3 blocks against transformers'."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.layers.moe import FusedExperts, run_grouped, run_per_token
from pdserve.engine.layers.moe_block import SparseMoeBlock, expert_param_target
from pdserve.engine.layers.router import select_experts
from pdserve.engine.moe_config import MoEConfig, RoutingConfig, moe_config_from_dict
from pdserve.engine.parallel import ParallelContext

H, INTER, E = 64, 32, 8


def _per_expert_tensors(fused: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers>=5 in-memory experts ([E, 2I, H] gate_up, [E, H, I] down) as checkpoints
    store them: `experts.<e>.gate_proj.weight` etc."""
    out = {k: v for k, v in fused.items() if not k.startswith("experts.")}
    gate_up, down = fused["experts.gate_up_proj"], fused["experts.down_proj"]
    inter = down.shape[-1]
    for e in range(gate_up.shape[0]):
        out[f"experts.{e}.gate_proj.weight"] = gate_up[e, :inter]
        out[f"experts.{e}.up_proj.weight"] = gate_up[e, inter:]
        out[f"experts.{e}.down_proj.weight"] = down[e]
    return out


def _load_block(block: SparseMoeBlock, tensors: dict[str, torch.Tensor]) -> None:
    params = dict(block.named_parameters())
    shared = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
              "down_proj": ("down_proj", None)}
    for name, t in tensors.items():
        name = name.replace("shared_experts.", "shared_expert.")
        target = expert_param_target(name)
        if target is not None:
            block.experts.weight_loader(params[target[0]], t, target[1])
        elif name.startswith("shared_expert."):
            part = name.split(".")[1]
            layer = getattr(block.shared_expert, shared[part][0])
            layer.weight_loader(layer.weight, t, shared[part][1])
        else:
            params[name].data.copy_(t)
    block.experts.check_loaded("experts")


def _random_experts(tp: ParallelContext, seed: int = 0) -> tuple[FusedExperts, dict]:
    g = torch.Generator().manual_seed(seed)
    # Scaled by fan-in so activations stay O(1) and fp32 sums agree to ~1e-6.
    shapes = {"w1": (INTER, H), "w3": (INTER, H), "w2": (H, INTER)}
    full = {(e, p): torch.randn(shape, generator=g) / shape[1] ** 0.5
            for e in range(E) for p, shape in shapes.items()}
    layer = FusedExperts(E, H, INTER, tp=tp)
    for (e, p), t in full.items():
        layer.weight_loader(layer.w2_weight if p == "w2" else layer.w13_weight, t, (e, p))
    layer.check_loaded("experts")
    return layer, full


def _routing_inputs(tokens: int, k: int = 2, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g)
    weights, ids = select_experts(torch.randn(tokens, E, generator=g),
                                  RoutingConfig(top_k=k, renormalize=True))
    return x, weights, ids


def _ranks(size: int, expert_parallel: bool) -> list[ParallelContext]:
    # The experts layer never calls a collective: any placeholder group will do.
    return [ParallelContext(r, size, object(), expert_parallel) for r in range(size)]


# -- the experts layer ---------------------------------------------------------------------
def test_grouped_path_equals_the_per_token_loop():
    layer, _ = _random_experts(ParallelContext())
    x, weights, ids = _routing_inputs(37)
    ids[:5] = torch.tensor([3, 5])  # a crowded expert and experts no token picks
    grouped, loop = run_grouped(layer, x, weights, ids), run_per_token(layer, x, weights, ids)
    torch.testing.assert_close(grouped, loop, rtol=1e-5, atol=1e-5)
    # and both are what the routing says: the weighted sum of the token's experts' MLPs
    t = 9
    by_hand = sum(w * layer.expert_mlp(e, x[t:t + 1])[0]
                  for w, e in zip(weights[t], ids[t].tolist(), strict=True))
    torch.testing.assert_close(grouped[t], by_hand, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
def test_rank_partials_sum_to_the_unsplit_layer(expert_parallel):
    whole, _ = _random_experts(ParallelContext())
    x, weights, ids = _routing_inputs(21)
    expected = whole(x, weights, ids)
    parts = [_random_experts(ctx)[0] for ctx in _ranks(2, expert_parallel)]
    if expert_parallel:
        assert [p.num_local for p in parts] == [E // 2] * 2
        assert [p.expert_start for p in parts] == [0, E // 2]
    else:
        assert all(p.w13_weight.shape == (E, INTER, H) for p in parts)  # half of 2 * I each
    for impl in ("grouped", "per_token"):
        for p in parts:
            p.impl = impl
        total = sum(p(x, weights, ids) for p in parts)
        torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-5)


def test_a_missing_expert_matrix_is_refused():
    layer = FusedExperts(E, H, INTER)
    for e in range(E):
        for p in ("w1", "w3", "w2"):
            if (e, p) != (6, "w3"):
                t = torch.zeros(H, INTER) if p == "w2" else torch.zeros(INTER, H)
                layer.weight_loader(layer.w2_weight if p == "w2" else layer.w13_weight, t,
                                    (e, p))
    with pytest.raises(ValueError, match=r"mlp\.experts\.6\.w3"):
        layer.check_loaded("mlp.experts")


def test_splits_that_do_not_divide_are_refused():
    with pytest.raises(ValueError, match="experts do not split"):
        FusedExperts(6, H, INTER, tp=ParallelContext(0, 4, object(), True))
    with pytest.raises(ValueError, match="intermediate size"):
        FusedExperts(E, H, 30, tp=ParallelContext(0, 4, object(), False))


def test_expert_checkpoint_names_map_to_the_stacked_parameters():
    assert expert_param_target("layers.0.mlp.experts.3.w1.weight") == (
        "layers.0.mlp.experts.w13_weight", (3, "w1"))
    assert expert_param_target("layers.1.mlp.experts.12.up_proj.weight") == (
        "layers.1.mlp.experts.w13_weight", (12, "w3"))
    assert expert_param_target("layers.1.mlp.experts.0.down_proj.weight_scale") == (
        "layers.1.mlp.experts.w2_scale", (0, "w2"))
    assert expert_param_target("layers.1.mlp.shared_expert.down_proj.weight") is None


# -- routing -----------------------------------------------------------------------------
def test_group_limited_routing_only_picks_from_the_best_groups():
    # 4 groups of 2 experts; the two best experts (0 and 4) are in groups 0 and 2.
    logits = torch.tensor([[5.0, 0.1, 1.0, 1e-3, 4.9, 1e-3, 0.5, 1e-3]]).log()
    routing = RoutingConfig(top_k=2, method="group_limited_greedy", num_groups=4,
                            topk_groups=1)
    _, ids = select_experts(logits, routing)
    assert sorted(ids[0].tolist()) == [0, 1]  # only group 0 may be used
    _, greedy = select_experts(logits, RoutingConfig(top_k=2))
    assert sorted(greedy[0].tolist()) == [0, 4]


def test_noaux_tc_bias_chooses_but_does_not_weigh():
    logits = torch.zeros(1, E)
    logits[0, 2] = 2.0
    bias = torch.zeros(E)
    bias[4] = bias[5] = 3.0  # group 2 of 4; unbiased, expert 2 would win
    routing = RoutingConfig(top_k=2, scoring="sigmoid", method="noaux_tc", num_groups=4,
                            topk_groups=1, renormalize=False, scaling_factor=2.0)
    weights, ids = select_experts(logits, routing, bias)
    assert sorted(ids[0].tolist()) == [4, 5]
    torch.testing.assert_close(weights, torch.full((1, 2), 2.0 * 0.5))  # 2 * sigmoid(0)


# -- DeepSeek MoE blocks against transformers' own modules -------------------------------------
def _deepseek(variant: str):
    """(family, transformers config, its MoE module class) of a tiny DeepSeek MoE block."""
    from transformers import DeepseekV2Config, DeepseekV3Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    common = dict(hidden_size=H, n_routed_experts=E, num_experts_per_tok=3,
                  moe_intermediate_size=INTER, n_shared_experts=2, num_hidden_layers=3,
                  first_k_dense_replace=1, routed_scaling_factor=2.5)
    if variant == "v2-greedy":
        return "deepseek_v2", DeepseekV2Config(**common, topk_method="greedy"), DeepseekV2Moe
    if variant == "v2-group-limited":
        return "deepseek_v2", DeepseekV2Config(**common, topk_method="group_limited_greedy",
                                               n_group=4, topk_group=2), DeepseekV2Moe
    norm = variant == "v3"
    return "deepseek_v3", DeepseekV3Config(**common, n_group=4, topk_group=2,
                                           norm_topk_prob=norm), DeepseekV3MoE


def _randomise(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            if name.endswith("e_score_correction_bias"):
                t.copy_(torch.rand(t.shape, generator=g) * 0.3)
            else:  # fan-in scaling keeps every activation O(1)
                t.copy_(torch.randn(t.shape, generator=g) / t.shape[-1] ** 0.5)


@pytest.mark.parametrize("variant", ["v2-greedy", "v2-group-limited", "v3", "v3-unnormalised"])
def test_deepseek_moe_block_matches_transformers(variant):
    family, hf_cfg, hf_cls = _deepseek(variant)
    moe = moe_config_from_dict(family, hf_cfg.to_dict())
    assert moe.sparse_layers == (1, 2) and moe.shared_intermediate_size == 2 * INTER
    ref = hf_cls(hf_cfg).eval()
    _randomise(ref, seed=3)
    block = SparseMoeBlock(moe, H)
    _load_block(block, _per_expert_tensors(ref.state_dict()))
    x = torch.randn(50, H, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = ref(x.unsqueeze(0))[0]
    torch.testing.assert_close(block(x), expected, rtol=1e-5, atol=1e-5)
    # The config's routing really differs from plain top-k on these tokens (groups, bias).
    if moe.routing.method != "greedy":
        _, ids = select_experts(block.gate(x), moe.routing, block.gate.e_score_correction_bias)
        scores = block.gate(x).softmax(-1)
        plain = torch.topk(scores, moe.routing.top_k, dim=-1).indices
        assert (ids.sort(-1).values != plain.sort(-1).values).any(dim=-1).sum() > 5


# -- config.json --------------------------------------------------------------------------------
def test_qwen_moe_sparse_layers_follow_step_and_mlp_only_layers():
    moe = moe_config_from_dict("qwen2_moe", {
        "num_hidden_layers": 6, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "decoder_sparse_step": 2, "mlp_only_layers": [3],
        "shared_expert_intermediate_size": 64, "norm_topk_prob": False})
    assert moe.sparse_layers == (1, 5)
    assert moe.shared_expert_gate and not moe.routing.renormalize


def test_configs_the_engine_cannot_run_are_refused():
    with pytest.raises(ValueError, match="norm_topk_prob"):
        moe_config_from_dict("deepseek_v2", {
            "num_hidden_layers": 2, "n_routed_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 8, "norm_topk_prob": True})
    with pytest.raises(ValueError, match="n_group"):
        MoEConfig(num_experts=6, intermediate_size=8, sparse_layers=(0,),
                  routing=RoutingConfig(top_k=2, num_groups=4, topk_groups=1))
