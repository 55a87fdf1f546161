"""W4A16: the 4-bit weight form, quantisation at load, the CPU kernel, the layers' loaders.

Error bounds used below, and why:
- The CPU kernel keeps `scale` and `zero = offset + 8 * scale` in bf16 (8-bit significand,
  relative rounding <= 2^-8), so each weight it multiplies by is off the exact value by at most
  8 * 2^-8 |scale| + 2^-8 |zero|; `_kernel_bound` is that, with 1% headroom.
- Its activations and outputs are bf16 too, so a product is within ~2^-8 of its magnitude
  (inputs and output rounded once each); we assert 2^-7 of the largest output.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from pdserve.engine import LLM
from pdserve.engine.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pdserve.engine.parallel import ParallelContext
from pdserve.engine.quant.int4 import Int4LinearMethod
from pdserve.engine.quant.int4_kernels import build_int4_matmul
from pdserve.engine.quant.int4_quantize import CLIP_SEARCH, default_group_size, quantize_int4
from pdserve.engine.quant.int4_weight import Int4Weight
from pdserve.kernels.cpu import best_isa
from tests.helpers.checkpoints import VOCAB, make_bigram, save_tiny
from tests.helpers.engine import random_prompts
from tests.helpers.int4_checkpoints import kernel_bound, random_int4
from tests.helpers.int4_rows import GEMV_ROWS

TP2_RANK1 = ParallelContext(rank=1, size=2, group=object())  # loading needs no collectives


# -- the 4-bit form ---------------------------------------------------------------------------
def test_splitting_groups_and_stacking_rows_keep_the_matrix():
    a, b = random_int4(16, 128, 64), random_int4(8, 128, 32, seed=1)
    torch.testing.assert_close(a.split_groups(16).dequantize(), a.dequantize(), rtol=0, atol=0)
    both = Int4Weight.cat_rows([a, b])
    assert both.group_size == 32 and both.shape == (24, 128)
    torch.testing.assert_close(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]),
                               rtol=0, atol=0)


def test_column_shards_must_fall_on_group_boundaries():
    w = random_int4(16, 128, 64)
    torch.testing.assert_close(w.narrow(1, 64, 64).dequantize(), w.dequantize()[:, 64:],
                               rtol=0, atol=0)
    with pytest.raises(ValueError, match="split a group of 64"):
        w.narrow(1, 32, 64)


def test_act_order_columns_dequantise_in_feature_order_and_refuse_column_shards():
    w = random_int4(8, 64, 32)
    order = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    ordered = Int4Weight(w.qweight, w.scale, w.offset, 32, column_order=order)
    dense = ordered.dequantize()
    torch.testing.assert_close(dense[:, order], w.dequantize(), rtol=0, atol=0)
    x = torch.randn(3, 64)
    torch.testing.assert_close(x @ dense.t(), x[:, order] @ w.dequantize().t())
    with pytest.raises(ValueError, match="act-order"):
        ordered.narrow(1, 0, 32)
    with pytest.raises(ValueError, match="act-order"):
        Int4Weight.cat_rows([ordered, w])


# -- quantisation at load ---------------------------------------------------------------------
def test_group_size_is_128_halved_until_it_divides_the_width():
    assert [default_group_size(k) for k in (1536, 576, 64, 48)] == [128, 64, 64, 16]
    with pytest.raises(ValueError, match="cannot be quantised"):
        default_group_size(40)


def test_round_to_nearest_error_is_half_a_step_and_the_clip_search_only_helps():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    w[3, 7] = 12.0  # an outlier: the range of its group is mostly wasted without clipping
    plain = quantize_int4(w, 64)  # the default: min/max
    step = plain.scale.repeat_interleave(64, 1)
    assert ((plain.dequantize() - w).abs() <= step / 2 + 1e-6).all()
    searched = quantize_int4(w, 64, clip_ratios=CLIP_SEARCH)
    err = lambda q: (q.dequantize() - w).square().view(64, 4, 64).sum(-1)  # noqa: E731
    assert (err(searched) <= err(plain) + 1e-6).all()
    assert err(searched).sum() < 0.95 * err(plain).sum()


# -- the CPU kernels ---------------------------------------------------------------------------
@pytest.mark.parametrize("group", [16, 32, 64, 128, 256, 512])
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["cpu", "cpu-torch"])
def test_cpu_kernels_multiply_by_the_4bit_matrix(name, group, model_dtype):
    if name == "cpu-torch" and group == 16:
        pytest.skip("torch's kernel takes groups of 32 and more")
    w = random_int4(40, 512, group)  # 40 rows: padded to a multiple of 16 inside torch's
    kernel = build_int4_matmul(w, model_dtype, name)
    assert kernel.name == name
    assert ((kernel.dequantize() - w.dequantize()).abs() <= kernel_bound(w)).all()
    x = torch.randn(7, 512, generator=torch.Generator().manual_seed(1)).to(model_dtype)
    out = kernel.matmul(x)
    assert out.dtype == model_dtype and out.shape == (7, 40)
    want = x.float() @ kernel.dequantize().t()
    # pdserve's kernel multiplies in fp32; torch's rounds activations to bf16
    tol = 2**-7 if name == "cpu-torch" or model_dtype != torch.float32 else 1e-5
    torch.testing.assert_close(out.float(), want, rtol=0, atol=tol * want.abs().max().item())


@pytest.mark.parametrize("name", ["cpu", "cpu-torch"])
def test_cpu_kernel_rows_do_not_depend_on_the_batch(name):
    kernel = build_int4_matmul(random_int4(64, 256, 64), torch.float32, name)
    # pdserve's kernel: within its GEMV's batches (the bound is the build's ISA's; the panel
    # range is checked apart in tests/kernels/test_quant_kernels.py).
    m = GEMV_ROWS[best_isa()] if name == "cpu" else 9
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(2))
    full = kernel.matmul(x)
    for rows in (slice(0, 1), slice(1, 3), slice(m - 1, m)):
        assert torch.equal(kernel.matmul(x[rows]), full[rows])


@pytest.mark.parametrize("m, onednn", [(40, True), (200, True), (200, False)])
def test_pdserve_cpu_kernel_is_the_default_and_its_batch_paths_multiply_the_same_matrix(
        m, onednn, monkeypatch):
    # 40 rows: the panel kernel; 200: prefill, through oneDNN on the dequantised weight
    # where torch has it, else dequantised tiles through at::mm (mkldnn turned off).
    w = random_int4(48, 96, 32)
    kernel = build_int4_matmul(w, torch.float32)
    assert kernel.name == "cpu" and kernel.packed.shape == (12, 192)  # quads of rows
    x = torch.randn(m, 96, generator=torch.Generator().manual_seed(3))
    want = x.double() @ kernel.dequantize().double().t()
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", onednn)
    got = kernel.matmul(x)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5 * want.abs().max().item())


def test_shapes_no_cpu_kernel_takes_fall_back_to_the_reference(caplog):
    w = random_int4(16, 48, 16)  # 48 inputs: not blocks of 32; groups of 16: not torch's
    with caplog.at_level(logging.WARNING):
        kernel = build_int4_matmul(w, torch.float32)
    assert kernel.name == "reference" and "groups of 16" in caplog.text
    x = torch.randn(2, 48)
    torch.testing.assert_close(kernel.matmul(x), x @ w.dequantize().t())
    with pytest.raises(ValueError, match="blocks of 32"):
        build_int4_matmul(w, torch.float32, "cpu")
    with pytest.raises(ValueError, match="int4 kernel must be one of"):
        build_int4_matmul(w, torch.float32, "gpu")


# -- the layers' loaders ----------------------------------------------------------------------
def _int4_layer(layer: LinearBase, **kw) -> Int4LinearMethod:
    method = Int4LinearMethod(**kw)
    layer.method = method
    method.prepare(layer)
    assert layer.weight.numel() == 0  # nothing dense is kept while loading
    return method


def _check_layer(method: Int4LinearMethod, want: Int4Weight) -> None:
    got = method.dequantize()
    assert got.shape == want.shape
    assert ((got - want.dequantize()).abs() <= kernel_bound(want)).all()


def test_fused_shards_land_in_their_own_rows_whatever_their_form():
    """q and k arrive as 4-bit weights with different groups, v dense (quantised at load)."""
    qkv = QKVParallelLinear(hidden=128, head_dim=16, num_heads=4, num_kv_heads=2)
    method = _int4_layer(qkv)
    q, k = random_int4(64, 128, 32), random_int4(32, 128, 64, seed=1)
    v = torch.randn(32, 128, generator=torch.Generator().manual_seed(2)) * 0.05
    for shard, loaded in (("v", v), ("k", k), ("q", q)):  # any order
        qkv.weight_loader(qkv.weight, loaded, shard)
    method.finalize(qkv)
    _check_layer(method, Int4Weight.cat_rows([q, k, quantize_int4(v, 128)]))


def test_tensor_parallel_rank_takes_its_rows_and_its_groups():
    gate, up = random_int4(64, 128, 32), random_int4(64, 128, 32, seed=1)
    merged = MergedColumnParallelLinear(128, [64, 64], tp=TP2_RANK1)
    method = _int4_layer(merged)
    merged.weight_loader(merged.weight, gate, 0)
    merged.weight_loader(merged.weight, up, 1)
    method.finalize(merged)
    _check_layer(method, Int4Weight.cat_rows([gate.rows(32, 32), up.rows(32, 32)]))

    down = random_int4(48, 128, 32, seed=2)
    row = RowParallelLinear(128, 48, bias=True, tp=TP2_RANK1)
    method = _int4_layer(row)
    row.weight_loader(row.weight, down)
    row.weight_loader(row.bias, torch.arange(48.0))  # all output rows: added after the reduce
    method.finalize(row)
    _check_layer(method, down.columns(64, 64))
    assert torch.equal(row.bias.data, torch.arange(48.0))


@pytest.mark.parametrize("form", ["int4", "dense"])
def test_a_tensor_parallel_degree_that_splits_a_group_is_refused_at_load(form):
    row = RowParallelLinear(128, 16, tp=TP2_RANK1)  # each rank: 64 input features
    _int4_layer(row, group_size=128)
    loaded = random_int4(16, 128, 128) if form == "int4" else torch.randn(16, 128)
    with pytest.raises(ValueError, match="tensor parallelism 2.*split a group of 128"):
        row.weight_loader(row.weight, loaded)


def test_a_fused_layer_missing_a_shard_is_refused():
    qkv = QKVParallelLinear(hidden=64, head_dim=16, num_heads=2, num_kv_heads=1)
    method = _int4_layer(qkv)
    qkv.weight_loader(qkv.weight, random_int4(32, 64, 32), "q")
    qkv.weight_loader(qkv.weight, random_int4(16, 64, 32), "v")
    with pytest.raises(ValueError, match="rows 32..47 were never loaded"):
        method.finalize(qkv)


# -- the whole model --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bigram_dir(tmp_path_factory):
    d = save_tiny(tmp_path_factory.mktemp("int4_bigram"), "llama", seed=5, hidden_size=256,
                  intermediate_size=VOCAB, num_attention_heads=8, num_key_value_heads=4)
    make_bigram(d)
    return d


@pytest.fixture(scope="module")
def int4_llm(bigram_dir):
    return LLM(str(bigram_dir), num_gpu_blocks=40, quantization="int4")


@pytest.fixture(scope="module")
def prompts():
    return random_prompts([256, 256], VOCAB, seed=11)


def _logits(llm: LLM, prompts) -> torch.Tensor:
    return torch.cat([llm.engine.prompt_logits(p) for p in prompts])


def test_linear_layers_are_4bit_and_embeddings_and_lm_head_are_not(int4_llm):
    model = int4_llm.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert linears and all(isinstance(m.method, Int4LinearMethod) for m in linears)
    assert all(m.weight.numel() == 0 and m.method.kernel.name == "cpu" for m in linears)
    packed = sum(m.method.kernel.nbytes() for m in linears)
    dense = sum(m.out_features * m.in_features * 4 for m in linears)
    assert packed < 0.17 * dense  # 4 bits + bf16 scale and zero per 128: ~0.14 of fp32
    assert model.lm_head.weight.dtype == torch.float32
    assert model.embed_tokens.weight.shape == (VOCAB, 256)


def test_int4_keeps_top1_predictions_of_the_full_precision_model(bigram_dir, int4_llm,
                                                                  prompts):
    ref = _logits(LLM(str(bigram_dir), num_gpu_blocks=40), prompts)
    q = _logits(int4_llm, prompts)
    succ = torch.tensor(json.loads((bigram_dir / "successors.json").read_text()))
    ids = torch.tensor([t for p in prompts for t in p])
    assert (ref.argmax(-1) == succ[ids]).float().mean() > 0.8  # the 4-bit layers decide
    agreement = (ref.argmax(-1) == q.argmax(-1)).float().mean().item()
    assert agreement >= 0.98, agreement  # measured 0.996


@pytest.mark.parametrize("lm_head", ["bf16", "int8", "int4"])
def test_lm_head_copies_leave_the_tied_embedding_alone(tiny_qwen2, lm_head):
    llm = LLM(str(tiny_qwen2), num_gpu_blocks=16, quantization="int4", lm_head_dtype=lm_head)
    model = llm.engine.runner.model
    assert model.lm_head.weight is model.embed_tokens.weight  # tied, still full precision
    assert model.embed_tokens.weight.shape[0] == VOCAB
    hidden = torch.randn(3, model.config.hidden_size)
    want = hidden @ model.embed_tokens.weight.t()
    got = model.compute_logits(hidden)
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < {"bf16": 0.01, "int8": 0.01, "int4": 0.15}[lm_head], rel


def test_an_untied_lm_head_keeps_only_its_copy(tiny_llama):
    dense = LLM(str(tiny_llama), num_gpu_blocks=16)
    hidden = torch.randn(2, dense.engine.model_config.hidden_size)
    want = dense.engine.runner.model.compute_logits(hidden)
    llm = LLM(str(tiny_llama), num_gpu_blocks=16, lm_head_dtype="bf16")  # no weight scheme
    head = llm.engine.runner.model.lm_head
    assert head.weight.numel() == 0 and head.method.weight.dtype == torch.bfloat16
    torch.testing.assert_close(llm.engine.runner.model.compute_logits(hidden), want,
                               rtol=0, atol=0.02 * want.abs().max().item())
    llm = LLM(str(tiny_llama), num_gpu_blocks=16, lm_head_dtype="int8")
    head = llm.engine.runner.model.lm_head
    assert head.weight.numel() == 0 and head.method.qweight.dtype == torch.int8
    torch.testing.assert_close(llm.engine.runner.model.compute_logits(hidden), want,
                               rtol=0, atol=0.02 * want.abs().max().item())
    with pytest.raises(ValueError, match="lm_head_dtype"):
        LLM(str(tiny_llama), lm_head_dtype="fp4")


def test_the_int4_kernel_is_an_engine_option_and_part_of_the_kv_key(tiny_qwen2):
    from pdserve.engine.quant.checkpoint import resolve_quantization

    llm = LLM(str(tiny_qwen2), num_gpu_blocks=16, quantization="int4", int4_kernel="cpu-torch")
    kernels = {m.method.kernel.name for m in llm.engine.runner.model.modules()
               if isinstance(m, LinearBase)}
    assert kernels == {"cpu-torch"}
    auto = resolve_quantization("int4", tiny_qwen2)
    named = resolve_quantization("int4", tiny_qwen2, int4_kernel="cpu-torch")
    assert auto.key != named.key  # bf16 activations make other KV than fp32 ones
    with pytest.raises(ValueError, match="int4_kernel"):
        LLM(str(tiny_qwen2), quantization="int4", int4_kernel="gpu")
