"""GPTQ and AWQ checkpoints: the formats are read exactly, refused clearly when unsupported.

The checkpoints are written by the tests' own quantiser and packer
(`tests/helpers/int4_checkpoints.py`); each returns the dequantised weight of every layer, which
the reader's `Int4Weight` must reproduce exactly and the loaded model's kernels within their
bf16 scale rounding (see test_int4_linear.py).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.engine import LLM
from pdserve.engine.checkpoint import open_checkpoint
from pdserve.engine.quant.checkpoint import resolve_quantization
from pdserve.engine.quant.hf_int4 import HfInt4Format, adapt_hf_int4_checkpoint
from pdserve.engine.quant.int4_scheme import Int4Scheme
from pdserve.engine.quant.int4_weight import Int4Weight
from tests.helpers.checkpoints import VOCAB
from tests.helpers.engine import random_prompts
from tests.helpers.int4_checkpoints import write_dense_copy, write_int4_checkpoint

VARIANTS = {
    "gptq": dict(method="gptq"),
    "gptq-sym-v2": dict(method="gptq", sym=True, v1=False),
    "gptq-act-order": dict(method="gptq", desc_act=True),
    "gptq-whole-row": dict(method="gptq", group=-1, sym=True),
    "awq": dict(method="awq"),
    "awq-g64": dict(method="awq", group=64),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_reader_reproduces_the_quantised_weights_exactly(tiny_llama, tmp_path, variant):
    ckpt = tmp_path / variant
    reference = write_int4_checkpoint(tiny_llama, ckpt, **VARIANTS[variant])
    scheme = resolve_quantization(None, ckpt)
    assert isinstance(scheme, Int4Scheme) and scheme.checkpoint.method == VARIANTS[variant][
        "method"]
    files = open_checkpoint(ckpt)
    got = dict(adapt_hf_int4_checkpoint(files.iter_weights(), files.weight_shapes(),
                                        scheme.checkpoint))
    for name in sorted(reference):
        w = got[name]
        assert isinstance(w, Int4Weight), name
        torch.testing.assert_close(w.dequantize(), reference[name], rtol=0, atol=0)
    act_order = [got[n].column_order is not None for n in reference]
    assert all(act_order) if variant == "gptq-act-order" else not any(act_order)
    assert "model.norm.weight" in got  # everything else passes through


@pytest.fixture(scope="module")
def act_order_pair(tiny_llama, tmp_path_factory):
    """A GPTQ act-order checkpoint and a dense copy holding its dequantised weights."""
    tmp = tmp_path_factory.mktemp("gptq")
    reference = write_int4_checkpoint(tiny_llama, tmp / "gptq", "gptq", desc_act=True)
    dense = write_dense_copy(tiny_llama, tmp / "dense", reference)
    return tmp / "gptq", dense, reference


def test_a_gptq_checkpoint_loads_as_int4_and_computes_its_own_weights(act_order_pair):
    ckpt, dense, reference = act_order_pair
    llm = LLM(str(ckpt), num_gpu_blocks=16)  # detected from config.json
    layer = llm.engine.runner.model.layers[1]
    p = "model.layers.1."
    want = torch.cat([reference[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
    got = layer.self_attn.qkv_proj.method.dequantize()
    # bf16 scale and zero in the CPU kernel: |error| <= 2^-8 (8 |scale| + |zero|) <= 2^-8 * 2.1
    # * max |w| (scale <= range / 15, zero is a value inside the group's range).
    assert (got - want).abs().max() <= 2**-8 * 2.1 * want.abs().max()
    assert layer.mlp.gate_up_proj.method.column_order is not None
    ref = LLM(str(dense), num_gpu_blocks=16)
    for prompt in random_prompts([9, 30], VOCAB, seed=3):
        a, b = llm.engine.prompt_logits(prompt), ref.engine.prompt_logits(prompt)
        assert ((a - b).norm() / b.norm()).item() < 0.03  # bf16 activations only
    none = LLM(str(dense), num_gpu_blocks=8).engine.scheduler.kv.hash_extra
    assert llm.engine.scheduler.kv.hash_extra != none


@pytest.mark.timeout(300)
def test_act_order_under_tensor_parallelism_is_refused(act_order_pair):
    with pytest.raises(ValueError, match="act-order"):
        LLM(str(act_order_pair[0]), num_gpu_blocks=16, tensor_parallel_size=2)


def test_incomplete_or_mixed_precision_checkpoints_are_refused(tiny_llama, tmp_path):
    ckpt = tmp_path / "gptq"
    write_int4_checkpoint(tiny_llama, ckpt, "gptq")
    tensors = load_file(str(ckpt / "model.safetensors"))
    dense = load_file(str(tiny_llama / "model.safetensors"))
    p = "model.layers.0.mlp.down_proj."
    del tensors[p + "qzeros"]
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="down_proj has no qzeros"):
        LLM(str(ckpt), num_gpu_blocks=8)
    for part in ("qweight", "scales", "g_idx"):
        del tensors[p + part]
    tensors[p + "weight"] = dense[p + "weight"]
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="mixed-precision"):
        LLM(str(ckpt), num_gpu_blocks=8)


def _config_dir(tmp_path, qc: dict):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": qc}))
    return tmp_path


GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
       "version": "gemm"}


@pytest.mark.parametrize("qc,match", [
    ({**GPTQ, "bits": 8}, "bits=8"),
    ({**GPTQ, "group_size": 7}, "group_size 7"),
    ({**GPTQ, "checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    ({**GPTQ, "lm_head": True}, "lm_head"),
    ({**GPTQ, "dynamic": {"-:.*down": {}}}, "dynamic"),
    ({**AWQ, "version": "gemv"}, "version 'gemv'"),
    ({**AWQ, "zero_point": False}, "zero_point"),
    ({**AWQ, "modules_to_not_convert": ["visual"]}, "modules_to_not_convert"),
    ({"quant_method": "bitsandbytes"}, "'bitsandbytes' is not supported"),
])
def test_unsupported_configurations_are_refused_by_name(tmp_path, qc, match):
    with pytest.raises(ValueError, match=match):
        resolve_quantization(None, _config_dir(tmp_path, qc))


def test_scheme_comes_from_the_checkpoint_and_a_contradicting_request_is_refused(tmp_path):
    gptq = _config_dir(tmp_path / "gptq", {**GPTQ, "checkpoint_format": "gptq"})
    assert resolve_quantization(None, gptq) == Int4Scheme(checkpoint=HfInt4Format(
        "gptq", 128, zero_offset=1))
    assert resolve_quantization("int4", gptq).key == "int4-gptq"
    autoawq = {"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "zero_point": True,
               "version": "GEMM"}  # AutoAWQ's own spelling
    assert resolve_quantization(None, _config_dir(tmp_path / "awq", autoawq)).checkpoint == (
        HfInt4Format("awq", 64))
    with pytest.raises(ValueError, match="checkpoint is gptq"):
        resolve_quantization("fp8", gptq)
    plain = _config_dir(tmp_path / "plain", {})
    (plain / "config.json").write_text("{}")
    assert resolve_quantization("int4", plain).key == "int4-g128"
    with pytest.raises(ValueError, match="quantization must be"):
        resolve_quantization("int3", plain)
