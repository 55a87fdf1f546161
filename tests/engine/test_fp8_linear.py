"""W8A8 FP8 linear layers: the quantised matmul, whole-model accuracy, FP8 checkpoints.

Error bounds used below, and why:
- E4M3 keeps 3 mantissa bits, so rounding a normal value costs at most 2^-4 (6.25%) of it,
  about 2.6% rms on Gaussian data. A product of two rounded operands has ~3.7% rms error and a
  dot product averages it, so one quantised linear on random data stays under 2^-4 relative
  (Frobenius) error.
- Through a whole model those errors chain (qkv -> attention -> o, gate/up -> act -> down,
  twice). On the 256-wide checkpoint the logits' relative rms error measures ~7.3% and the
  largest single-logit error ~0.36 standard deviations of the logits; we assert 0.12 and 0.6,
  about 1.6x headroom, well below what a wrong scale or a misplaced shard produces (>1).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    LinearMethod,
    QKVParallelLinear,
    RowParallelLinear,
)
from pdserve.engine.parallel import ParallelContext
from pdserve.engine.quant.checkpoint import resolve_quantization
from pdserve.engine.quant.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    Fp8LinearMethod,
    dequantize_rows,
    quantize_rows,
)
from pdserve.engine.quant.fp8_scheme import DEFAULT_FULL_PRECISION, Fp8Scheme, scale_column
from tests.helpers.checkpoints import VOCAB, make_bigram, save_tiny
from tests.helpers.engine import random_prompts

_LINEAR_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# -- checkpoints -----------------------------------------------------------------------------
def write_fp8_checkpoint(src: Path, dst: Path, per_tensor: bool = False,
                         flat_scales: bool = False) -> Path:
    """An FP8 copy of a full-precision checkpoint, as quantising tools write them: E4M3
    linear weights, a `weight_scale` each, and quantization_config in config.json."""
    shutil.copytree(src, dst)
    out = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if not (name.endswith(".weight") and any(f".{p}." in name for p in _LINEAR_PARTS)):
            out[name] = t
            continue
        if per_tensor:
            scale = (t.abs().max() / FP8_MAX).float()
            q = (t / scale).to(FP8_DTYPE)
        else:
            q, scale = quantize_rows(t)
            scale = scale.flatten() if flat_scales else scale
        out[name], out[name.removesuffix("weight") + "weight_scale"] = q, scale
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def bigram_dir(tmp_path_factory):
    d = save_tiny(tmp_path_factory.mktemp("fp8_bigram"), "llama", seed=5, hidden_size=256,
                  intermediate_size=VOCAB, num_attention_heads=8, num_key_value_heads=4)
    make_bigram(d)
    return d


@pytest.fixture(scope="module")
def ref_llm(bigram_dir):
    return LLM(str(bigram_dir), num_gpu_blocks=32)


@pytest.fixture(scope="module")
def fp8_llm(bigram_dir):
    # Every linear layer in FP8 (not the default recipe, which keeps some in full precision):
    # these tests are about the quantised math itself.
    return LLM(str(bigram_dir), num_gpu_blocks=32, quantization="fp8",
               fp8_full_precision_layers=())


@pytest.fixture(scope="module")
def prompts():
    # Few long prompts: on CPU an FP8 matmul costs about the same for 1 or 256 rows.
    return random_prompts([256, 256], VOCAB, seed=11)


@pytest.fixture(scope="module")
def logits_pair(ref_llm, fp8_llm, prompts):
    """(full precision, FP8) logits at every position of `prompts`."""
    return _logits(ref_llm, prompts), _logits(fp8_llm, prompts)


def _logits(llm: LLM, prompts) -> torch.Tensor:
    return torch.cat([llm.engine.prompt_logits(p) for p in prompts])


def _quantised_linear(layer: LinearBase, weight: torch.Tensor,
                      bias: torch.Tensor | None = None) -> Fp8LinearMethod:
    layer.weight.data.copy_(weight)
    if bias is not None:
        layer.bias.data.copy_(bias)
    method = Fp8LinearMethod()
    layer.method = method
    method.finalize(layer)
    return method


# -- one layer ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantised_linear_is_close_to_the_float_matmul(dtype):
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(192, 256, generator=g), torch.randn(192, generator=g)
    x = torch.randn(3, 37, 256, generator=g)
    x[0, 5] = 0.0  # an all-zero token must not divide by a zero scale
    layer = ColumnParallelLinear(256, 192, bias=True, dtype=dtype)
    method = _quantised_linear(layer, w.to(dtype), b.to(dtype))
    out = layer(x.to(dtype))
    assert out.dtype == dtype and out.shape == (3, 37, 192)
    assert method.fallback_reason is None  # _scaled_mm took these shapes on this device
    ref = F.linear(x, w.to(dtype).float(), b.to(dtype).float())
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    assert rel < 2 ** -4, rel
    assert torch.allclose(out[0, 5].float(), b.to(dtype).float(), atol=1e-2)


def test_scaled_mm_applies_both_row_scales_exactly():
    """Against the same quantised operands multiplied in fp32: only summation order differs."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 128, generator=g) * torch.linspace(0.01, 10, 96).unsqueeze(1)
    x = torch.randn(9, 128, generator=g) * torch.linspace(0.1, 100, 9).unsqueeze(1)
    layer = ColumnParallelLinear(128, 96)
    _quantised_linear(layer, w)
    assert layer.weight.dtype == FP8_DTYPE and layer.weight_scale.shape == (96, 1)
    xq, xs = quantize_rows(x)
    expect = dequantize_rows(xq, xs) @ dequantize_rows(layer.weight, layer.weight_scale).t()
    torch.testing.assert_close(layer(x), expect, rtol=1e-5, atol=1e-5 * expect.abs().max())


def test_dequantising_fallback_gives_the_same_result():
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(64, 96, generator=g), torch.randn(5, 96, generator=g)
    layer = ColumnParallelLinear(96, 64)
    method = _quantised_linear(layer, w)
    fast = layer(x)
    method.fallback_reason = "forced by the test"
    torch.testing.assert_close(layer(x), fast, rtol=1e-5, atol=1e-5)


# -- the whole model ---------------------------------------------------------------------------
def test_linear_layers_are_fp8_and_embeddings_and_lm_head_are_not(fp8_llm):
    model = fp8_llm.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert linears and all(m.weight.dtype == FP8_DTYPE for m in linears)
    assert all(isinstance(m.method, Fp8LinearMethod) for m in linears)
    assert model.embed_tokens.weight.dtype == torch.float32
    assert model.lm_head.weight.dtype == torch.float32


class _FakeFp8(LinearMethod):
    """Quantise-dequantise in fp32: what W8A8 means, without any FP8 kernel."""

    def apply(self, layer, x, bias):
        q, s = quantize_rows(x.reshape(-1, x.shape[-1]))
        w = dequantize_rows(*quantize_rows(layer.weight))
        return F.linear(dequantize_rows(q, s).view_as(x), w, bias)


def test_fp8_model_computes_exactly_the_quantised_math(bigram_dir, logits_pair, prompts):
    fake = LLM(str(bigram_dir), num_gpu_blocks=32)
    for m in fake.engine.runner.model.modules():
        if isinstance(m, LinearBase):
            m.method = _FakeFp8()
    want, got = _logits(fake, prompts), logits_pair[1]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.std().item())


def test_fp8_keeps_top1_predictions_of_the_full_precision_model(logits_pair, prompts,
                                                                 bigram_dir):
    ref, q = logits_pair
    succ = torch.tensor(json.loads((bigram_dir / "successors.json").read_text()))
    ids = torch.tensor([t for p in prompts for t in p])
    # The check is about something: the quantised lookup layer decides most argmaxes.
    assert (ref.argmax(-1) == succ[ids]).float().mean() > 0.8
    agreement = (ref.argmax(-1) == q.argmax(-1)).float().mean().item()
    assert agreement >= 0.99, agreement


def test_fp8_logit_error_is_bounded(logits_pair):
    ref, q = logits_pair
    centred = ref - ref.mean(-1, keepdim=True)
    rel = (q - ref).norm(dim=-1) / centred.norm(dim=-1)
    assert rel.max() < 0.12, rel.max()
    worst = ((q - ref).abs() / ref.std(-1, keepdim=True)).max()
    assert worst < 0.6, worst


# -- FP8 checkpoints ---------------------------------------------------------------------------
@pytest.mark.parametrize("flat_scales", [False, True], ids=["scale_Nx1", "scale_N"])
def test_fp8_checkpoint_gives_the_logits_of_quantise_at_load(tiny_llama, tmp_path, flat_scales):
    ckpt = write_fp8_checkpoint(tiny_llama, tmp_path / "fp8", flat_scales=flat_scales)
    loaded = LLM(str(ckpt), num_gpu_blocks=16)  # detected from config.json
    at_load = LLM(str(tiny_llama), num_gpu_blocks=16, quantization="fp8",
                  fp8_full_precision_layers=())
    linears = [m for m in loaded.engine.runner.model.modules() if isinstance(m, LinearBase)]
    assert all(m.method.serialized and m.weight.dtype == FP8_DTYPE for m in linears)
    for p in random_prompts([23, 40], VOCAB, seed=3):
        torch.testing.assert_close(loaded.engine.prompt_logits(p),
                                   at_load.engine.prompt_logits(p), rtol=0, atol=1e-6)


def test_per_tensor_scales_of_fused_layers_land_in_their_own_rows(tiny_llama, tmp_path):
    ckpt = write_fp8_checkpoint(tiny_llama, tmp_path / "fp8t", per_tensor=True)
    llm = LLM(str(ckpt), num_gpu_blocks=16, quantization="fp8")
    src = load_file(str(ckpt / "model.safetensors"))
    layer = llm.engine.runner.model.layers[1]

    def deq(name):
        p = f"model.layers.1.{name}."
        return src[p + "weight"].float() * src[p + "weight_scale"]

    fused = {layer.self_attn.qkv_proj: ["self_attn.q_proj", "self_attn.k_proj",
                                        "self_attn.v_proj"],
             layer.mlp.gate_up_proj: ["mlp.gate_proj", "mlp.up_proj"],
             layer.mlp.down_proj: ["mlp.down_proj"]}
    for module, parts in fused.items():
        got = dequantize_rows(module.weight, module.weight_scale)
        torch.testing.assert_close(got, torch.cat([deq(n) for n in parts]), rtol=0, atol=0)
    scales = {src[f"model.layers.1.{n}.weight_scale"].item() for n in fused[layer.mlp.gate_up_proj]}
    assert len(scales) == 2  # the two shards really had different scales
    out = llm.generate([[5, 6, 7, 8]], None)[0]
    assert out.token_ids


def test_scales_shard_like_the_weight_rows_under_tensor_parallelism():
    tp = ParallelContext(rank=1, size=2, group=object())  # loading needs no collectives
    serialized = Fp8LinearMethod(serialized=True)
    qkv = QKVParallelLinear(hidden=16, head_dim=4, num_heads=4, num_kv_heads=2, tp=tp)
    serialized.prepare(qkv)
    for shard, rows, value in (("q", 16, 1.0), ("k", 8, 2.0), ("v", 8, 3.0)):
        full = torch.arange(rows, dtype=torch.float32) + 100 * value  # per-channel [N]
        qkv.weight_loader(qkv.weight_scale, scale_column(full, rows), shard)
    # rank 1 holds query heads 2-3 (rows 8..15) and KV head 1 (rows 4..7 of k and of v)
    want = torch.cat([torch.arange(8, 16) + 100.0, torch.arange(4, 8) + 200.0,
                      torch.arange(4, 8) + 300.0]).unsqueeze(1)
    torch.testing.assert_close(qkv.weight_scale.data, want)
    row = RowParallelLinear(16, 6, tp=tp)
    Fp8LinearMethod(serialized=True).prepare(row)
    row.weight_loader(row.weight_scale, scale_column(torch.tensor(0.5), 6))
    assert torch.equal(row.weight_scale.data, torch.full((6, 1), 0.5))  # output rows: all


def _write_config(d: Path, quantization_config) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"quantization_config": quantization_config}))
    return d


def test_quantization_scheme_comes_from_the_request_or_the_checkpoint(tmp_path):
    plain = _write_config(tmp_path / "plain", None)
    assert resolve_quantization(None, plain) is None
    assert resolve_quantization("fp8", plain) == Fp8Scheme(serialized=False)
    fp8 = _write_config(tmp_path / "fp8", {"quant_method": "fp8", "ignored_layers": ["lm_head"]})
    assert resolve_quantization(None, fp8) == Fp8Scheme(serialized=True)
    with pytest.raises(ValueError, match="quant_method"):
        resolve_quantization(None, _write_config(tmp_path / "bnb", {"quant_method": "bnb"}))
    with pytest.raises(ValueError, match="weight_block_size"):
        resolve_quantization(None, _write_config(
            tmp_path / "blk", {"quant_method": "fp8", "weight_block_size": [128, 128]}))
    with pytest.raises(ValueError, match="ignores layers"):
        resolve_quantization(None, _write_config(
            tmp_path / "mix", {"quant_method": "fp8", "ignored_layers": ["model.layers.0.mlp"]}))
    with pytest.raises(ValueError, match="quantization must be"):
        resolve_quantization("int8", plain)
    with pytest.raises(ValueError, match="checkpoint is fp8"):
        resolve_quantization("int4", fp8)


def test_fp8_checkpoint_without_a_weight_scale_is_rejected(tiny_llama, tmp_path):
    ckpt = write_fp8_checkpoint(tiny_llama, tmp_path / "noscale")
    tensors = load_file(str(ckpt / "model.safetensors"))
    del tensors["model.layers.0.mlp.down_proj.weight_scale"]
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing weights"):
        LLM(str(ckpt), num_gpu_blocks=16)


@pytest.mark.timeout(300)
def test_fp8_checkpoint_and_fp8_cache_under_tp2_match_tp1(tiny_llama, tmp_path):
    """Real TP=2 ranks load per-tensor FP8 scales (row-parallel layers keep every output
    row's scale) and run with an FP8 cache. Row-parallel layers quantise each rank's input
    slice with its own per-token scale, so TP=2 is close to TP=1, not bit-identical: about
    one more activation rounding (<= 2^-4) per layer; measured 3% at worst, bound 8%."""
    ckpt = str(write_fp8_checkpoint(tiny_llama, tmp_path / "fp8tp", per_tensor=True))
    prompt = random_prompts([37], VOCAB, seed=8)[0]
    want = LLM(ckpt, num_gpu_blocks=16, kv_cache_dtype="fp8").engine.prompt_logits(prompt)
    with LLM(ckpt, num_gpu_blocks=16, kv_cache_dtype="fp8", tensor_parallel_size=2) as llm:
        got = llm.engine.prompt_logits(prompt)
        out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0))[0]
        assert len(out.token_ids) == 4
    rel = (got - want).norm(dim=-1) / (want - want.mean(-1, keepdim=True)).norm(dim=-1)
    assert rel.max() < 0.08, rel.max()


# -- mixed-precision recipes (fp8_full_precision_layers) --------------------------------------
def test_default_recipe_keeps_its_layers_in_full_precision(tiny_llama):
    llm = LLM(str(tiny_llama), num_gpu_blocks=16, quantization="fp8")
    scheme = Fp8Scheme()
    assert scheme.full_precision == DEFAULT_FULL_PRECISION
    for name, m in llm.engine.runner.model.named_modules():
        if isinstance(m, LinearBase):
            kept = name.startswith("layers.0.") or name.endswith("mlp.down_proj")
            assert (m.weight.dtype == torch.float32) == kept, name
            assert isinstance(m.method, Fp8LinearMethod) != kept, name


def test_full_precision_patterns_choose_layers_and_name_the_numerics():
    every, some = Fp8Scheme(full_precision=()), Fp8Scheme(full_precision=["*.o_proj"])
    assert some.full_precision == ("*.o_proj",)  # a JSON list becomes a tuple
    assert every.covers("layers.3.self_attn.o_proj")
    assert not some.covers("layers.3.self_attn.o_proj")
    assert some.covers("layers.3.self_attn.qkv_proj")
    assert len({every.key, some.key, Fp8Scheme().key}) == 3  # KV never shared across recipes
    assert Fp8Scheme(serialized=True).full_precision == ()
    with pytest.raises(ValueError, match="patterns"):
        Fp8Scheme(full_precision="layers.0.*")
    with pytest.raises(ValueError, match="as it is stored"):
        Fp8Scheme(serialized=True, full_precision=("layers.0.*",))


def test_full_precision_option_is_validated(tmp_path):
    plain = _write_config(tmp_path / "plain", None)
    fp8 = _write_config(tmp_path / "fp8", {"quant_method": "fp8"})
    assert resolve_quantization("fp8", plain, ["*.down_proj"]).full_precision == (
        "*.down_proj",)
    with pytest.raises(ValueError, match="already fp8"):
        resolve_quantization("fp8", fp8, ["*.down_proj"])
    with pytest.raises(ValueError, match="needs quantization='fp8'"):
        resolve_quantization("int4", plain, ())
    with pytest.raises(ValueError, match="needs quantization='fp8'"):
        EngineConfig(model="m", fp8_full_precision_layers=("layers.0.*",))
    with pytest.raises(ValueError, match="non-empty"):
        EngineConfig(model="m", quantization="fp8", fp8_full_precision_layers=("",))
    cfg = EngineConfig(model="m", quantization="fp8", fp8_full_precision_layers=["a.*"])
    assert cfg.fp8_full_precision_layers == ("a.*",)  # as the TP followers rebuild it
