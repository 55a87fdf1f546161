"""GGUF checkpoints: every tensor type equals the gguf package's dequantisation, 4-bit blocks
become `Int4Weight`s equal to it too, and unsupported files are refused by name."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from pdserve.engine.checkpoint import open_checkpoint
from pdserve.engine.checkpoint.gguf_file import GGUFCheckpoint
from pdserve.engine.checkpoint.gguf_int4 import int4_from_blocks
from pdserve.engine.checkpoint.gguf_names import SUPPORTED_TYPES
from pdserve.engine.checkpoint.gguf_weights import hf_row_order, load_tensor
from pdserve.engine.quant.int4_weight import Int4Weight
from tests.helpers.checkpoints import save_tiny
from tests.helpers.gguf_files import (
    byte_level_vocab,
    encode,
    gguf_from_hf,
    llama_cpp_permute,
    write_gguf,
)

gguf = pytest.importorskip("gguf")

ALL_TYPES = sorted(SUPPORTED_TYPES)
HPARAMS = {"context_length": 64, "embedding_length": 256, "block_count": 1,
           "feed_forward_length": 256, "attention.head_count": 4, "attention.head_count_kv": 2,
           "attention.layer_norm_rms_epsilon": 1e-5, "rope.freq_base": 10000.0}


@pytest.fixture(scope="module")
def vocab_dir(tmp_path_factory) -> Path:
    from pdserve.demo_model import write_tokenizer_files

    return write_tokenizer_files(tmp_path_factory.mktemp("tok"), vocab_size=512)


@pytest.fixture(scope="module")
def every_type(tmp_path_factory, vocab_dir) -> GGUFCheckpoint:
    """One 8 x 256 tensor of each supported type (names are never mapped here)."""
    rng = np.random.default_rng(0)
    values = rng.standard_normal((8, 256)).astype(np.float32) * 0.1
    tensors = [(f"t.{kind}", encode(values, kind, rng), kind) for kind in ALL_TYPES]
    path = write_gguf(tmp_path_factory.mktemp("types") / "types.gguf", "llama", HPARAMS,
                      tensors, byte_level_vocab(vocab_dir))
    return GGUFCheckpoint(path)


def _dequantized(t) -> torch.Tensor:
    """The gguf package's own dequantisation of a reader tensor (the reference)."""
    return torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type),
                                     dtype=np.float32).reshape(8, 256))


@pytest.mark.parametrize("kind", ALL_TYPES)
def test_every_type_loads_as_the_gguf_package_dequantises_it(every_type, kind):
    t = next(t for t in every_type.reader.tensors if t.name == f"t.{kind}")
    ours = load_tensor(t.data, kind, (8, 256), linear=True, prefer_int4=False,
                       permute_heads=None)
    ref = _dequantized(t)
    assert ours.dtype == torch.float32 and ours.shape == (8, 256)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_4bit_blocks_become_int4_weights_equal_to_the_dequantisation(every_type, kind):
    t = next(t for t in every_type.reader.tensors if t.name == f"t.{kind}")
    w = load_tensor(t.data, kind, (8, 256), linear=True, prefer_int4=True, permute_heads=None)
    assert isinstance(w, Int4Weight) and w.group_size == 32 and w.qweight.dtype == torch.uint8
    assert int(w.qweight.max()) <= 15
    ref = _dequantized(t)
    torch.testing.assert_close(w.dequantize(), ref, rtol=0, atol=1e-6)


def test_int4_rows_permute_like_the_dense_weight(every_type):
    t = next(t for t in every_type.reader.tensors if t.name == "t.Q4_K")
    w = load_tensor(t.data, "Q4_K", (8, 256), linear=True, prefer_int4=True, permute_heads=2)
    dense = load_tensor(t.data, "Q4_K", (8, 256), linear=True, prefer_int4=False,
                        permute_heads=2)
    assert isinstance(w, Int4Weight)
    assert torch.equal(w.dequantize(), dense)


def test_only_4bit_linear_weights_come_out_as_int4(every_type):
    q8 = next(t for t in every_type.reader.tensors if t.name == "t.Q8_0")
    q4 = next(t for t in every_type.reader.tensors if t.name == "t.Q4_0")
    assert isinstance(load_tensor(q8.data, "Q8_0", (8, 256), linear=True, prefer_int4=True,
                                  permute_heads=None), torch.Tensor)
    assert isinstance(load_tensor(q4.data, "Q4_0", (8, 256), linear=False, prefer_int4=True,
                                  permute_heads=None), torch.Tensor)  # e.g. an embedding


def test_int4_refuses_rows_that_are_not_whole_blocks():
    with pytest.raises(ValueError, match="not whole Q4_K blocks"):
        int4_from_blocks(np.zeros((2, 144), np.uint8), "Q4_K", (2, 128))


def test_row_order_undoes_llama_cpp_permute():
    w = np.arange(6 * 16 * 3, dtype=np.float32).reshape(6 * 16, 3)  # 6 heads of dim 16
    stored = torch.from_numpy(llama_cpp_permute(w, 6))
    assert torch.equal(stored.index_select(0, hf_row_order(96, 6)), torch.from_numpy(w))


# -- whole files ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("hf"), "llama", seed=4)


def test_iter_weights_maps_every_tensor_to_hf_names(tmp_path, tiny_hf):
    path = gguf_from_hf(tiny_hf, tmp_path / "m.gguf", "llama",
                        lambda n: "Q4_0" if ".attn_q." in n else "F32")
    ck = open_checkpoint(path)
    got = dict(ck.iter_weights(prefer_int4=True))
    from safetensors.torch import load_file

    want = load_file(str(tiny_hf / "model.safetensors"))
    assert set(got) == set(want)
    for name, tensor in want.items():
        value = got[name]
        if ".q_proj." in name:  # Q4_0 in the file: 4-bit, rows back in HF order
            assert isinstance(value, Int4Weight)
            torch.testing.assert_close(value.dequantize(), tensor, atol=0.02, rtol=0)
        else:
            assert torch.equal(value, tensor), name  # F32: exact, k un-permuted
    assert ck.weight_shapes()["model.layers.0.self_attn.k_proj.weight"] == list(
        want["model.layers.0.self_attn.k_proj.weight"].shape)


def test_model_loader_hands_int4_weights_to_the_layer_unchanged(tmp_path, tiny_hf):
    from pdserve.engine.models import MODEL_CLASSES

    path = gguf_from_hf(tiny_hf, tmp_path / "m.gguf", "llama",
                        lambda n: "Q4_1" if ".ffn_up." in n else "F32")
    ck = open_checkpoint(path)
    model = MODEL_CLASSES["llama"](ck.model_config, torch.float32)
    seen = []
    for layer in model.layers:  # a spy in place of each gate/up layer's own loader
        layer.mlp.gate_up_proj.weight_loader = lambda p, value, shard: seen.append((shard, value))
    model.load_weights(ck.iter_weights(prefer_int4=True))
    kinds = {(shard, type(value)) for shard, value in seen}
    assert kinds == {(0, torch.Tensor), (1, Int4Weight)}  # gate F32, up Q4_1


def test_a_directory_holding_one_gguf_is_served_under_its_name(tmp_path, tiny_hf):
    d = tmp_path / "My-Model"
    d.mkdir()
    gguf_from_hf(tiny_hf, d / "whatever.Q8_0.gguf", "llama")
    ck = open_checkpoint(d)
    assert ck.format == "gguf" and ck.model_id == "My-Model"
    assert open_checkpoint(d / "whatever.Q8_0.gguf").model_id == "whatever.Q8_0"
    shutil.copy(d / "whatever.Q8_0.gguf", d / "other.gguf")
    with pytest.raises(ValueError, match="holds 2 .gguf files"):
        open_checkpoint(d)


def test_paths_that_are_no_checkpoint_are_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="not a GGUF file"):
        open_checkpoint(tmp_path / "notes.txt")
    with pytest.raises(ValueError, match="neither a config.json"):
        open_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        open_checkpoint(tmp_path / "missing")
    (tmp_path / "bad.gguf").write_bytes(b"GGUF\x03\x00\x00\x00truncated")
    with pytest.raises(ValueError, match="not a readable GGUF"):
        _ = open_checkpoint(tmp_path / "bad.gguf").model_config


def _tiny_file(tmp_path, vocab_dir, arch="llama", tensors=None, **kw) -> Path:
    rng = np.random.default_rng(1)
    tensors = tensors or [("token_embd.weight", encode(
        rng.standard_normal((512, 256)).astype(np.float32), "F32", rng), "F32")]
    return write_gguf(tmp_path / "m.gguf", arch, HPARAMS, tensors,
                      byte_level_vocab(vocab_dir), **kw)


def test_an_unsupported_architecture_is_refused_by_name(tmp_path, vocab_dir):
    path = _tiny_file(tmp_path, vocab_dir, arch="gemma2")
    with pytest.raises(ValueError, match="architecture 'gemma2' is not supported"):
        _ = open_checkpoint(path).model_config


def test_an_unsupported_tensor_type_is_refused_by_name(tmp_path, vocab_dir):
    blocks = np.zeros((512, 256 // 32 * 18), np.uint8)  # IQ4_NL: 18 bytes per 32 values
    path = _tiny_file(tmp_path, vocab_dir, tensors=[("token_embd.weight", blocks, "IQ4_NL")])
    with pytest.raises(ValueError, match="'token_embd.weight' is stored as IQ4_NL"):
        _ = open_checkpoint(path).model_config


def test_a_tensor_the_model_has_no_place_for_is_refused(tmp_path, vocab_dir):
    rng = np.random.default_rng(2)
    extra = ("blk.0.attn_q_norm.weight", np.ones(64, np.float32), "F32")
    base = ("token_embd.weight", rng.standard_normal((512, 256)).astype(np.float32), "F32")
    path = _tiny_file(tmp_path, vocab_dir, tensors=[base, extra])
    with pytest.raises(ValueError, match="'blk.0.attn_q_norm.weight' has no place"):
        _ = open_checkpoint(path).model_config


def test_unsupported_hyper_parameters_are_refused_by_name(tmp_path, vocab_dir):
    path = _tiny_file(tmp_path, vocab_dir, extra=lambda w: w.add_string(
        "llama.rope.scaling.type", "yarn"))
    with pytest.raises(ValueError, match="rope.scaling.type 'yarn'"):
        _ = open_checkpoint(path).model_config
    path = _tiny_file(tmp_path, vocab_dir,
                      extra=lambda w: w.add_uint32("llama.rope.dimension_count", 32))
    with pytest.raises(ValueError, match="partial rotary"):
        _ = open_checkpoint(path).model_config


def test_an_unknown_tokenizer_is_refused_by_name(tmp_path, vocab_dir):
    path = _tiny_file(tmp_path, vocab_dir, pre="made-up-pre")
    with pytest.raises(ValueError, match="tokenizer.ggml.pre 'made-up-pre' is not supported"):
        open_checkpoint(path).tokenizer()


def test_model_config_from_metadata(tmp_path, tiny_hf):
    ck = open_checkpoint(gguf_from_hf(tiny_hf, tmp_path / "m.gguf", "llama"))
    cfg = ck.model_config
    hf = open_checkpoint(tiny_hf).model_config
    assert (cfg.family, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim, cfg.intermediate_size, cfg.vocab_size) == (
        "llama", hf.num_layers, hf.hidden_size, hf.num_heads, hf.num_kv_heads, hf.head_dim,
        hf.intermediate_size, hf.vocab_size)
    assert cfg.rope.theta == hf.rope.theta and cfg.tie_word_embeddings == hf.tie_word_embeddings
    assert ck.eos_token_ids == frozenset({2}) and cfg.torch_dtype == "float32"
