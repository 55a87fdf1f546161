"""pdserve.demo_model: the random-weight Llama checkpoint, its tokenizer and its cache."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pdserve import demo_model
from pdserve.demo_model import (
    DEMO_MODEL_NAME,
    DemoModelConfig,
    build_tokenizer,
    ensure_demo_model,
    materialize_dir,
    write_demo_model,
)
from pdserve.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)
STRINGS = ["Hello world!", "def main():\n    return 0\n", "naïve 你好 😀👍🏽", "  two  spaces", ""]


def digests(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("tiny"), seed=0, **TINY)


@pytest.fixture(scope="module")
def full_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("cache")
    old = os.environ.get("PDSERVE_CACHE_DIR")
    os.environ["PDSERVE_CACHE_DIR"] = str(cache)
    try:
        path = ensure_demo_model()
    finally:
        if old is None:
            del os.environ["PDSERVE_CACHE_DIR"]
        else:
            os.environ["PDSERVE_CACHE_DIR"] = old
    assert path == cache / DEMO_MODEL_NAME
    return path


# -- files and weights -------------------------------------------------------------------------


def test_tiny_checkpoint_matches_hf_llama_layout(tiny_dir: Path) -> None:
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["head_dim"] == 16 and config["num_key_value_heads"] == 2
    hf_config = transformers.AutoConfig.from_pretrained(tiny_dir)
    expected = transformers.LlamaForCausalLM(hf_config).state_dict()
    ours = load_file(tiny_dir / "model.safetensors")
    assert {k: tuple(v.shape) for k, v in ours.items()} == {
        k: tuple(v.shape) for k, v in expected.items() if "rotary" not in k}
    assert all(v.dtype == torch.float32 for v in ours.values())
    assert torch.equal(ours["model.norm.weight"], torch.ones(64))
    std = ours["model.layers.0.mlp.up_proj.weight"].std().item()
    assert 0.018 < std < 0.022


def test_tiny_checkpoint_runs_in_transformers_with_our_tokenizer(tiny_dir: Path) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir)
    tok = Tokenizer.from_pretrained(tiny_dir)
    ids = torch.tensor([tok.encode("Hello world")])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 512) and torch.isfinite(logits).all()
    assert tok.vocab_size == 512 and tok.eos_token_ids == frozenset({2})


def test_tied_embeddings_variant_has_no_lm_head(tmp_path: Path) -> None:
    write_demo_model(tmp_path, tie_word_embeddings=True, **TINY)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_same_seed_writes_identical_bytes_other_seed_other_weights(
    tiny_dir: Path, tmp_path: Path
) -> None:
    same = digests(write_demo_model(tmp_path / "same", seed=0, **TINY))
    other = digests(write_demo_model(tmp_path / "other", seed=1, **TINY))
    assert same == digests(tiny_dir)
    assert other["model.safetensors"] != same["model.safetensors"]
    assert other["tokenizer.json"] == same["tokenizer.json"]


def test_fresh_process_with_other_hash_seed_writes_identical_bytes(
    tiny_dir: Path, tmp_path: Path
) -> None:
    code = ("import sys; from pdserve.demo_model import write_demo_model; "
            f"write_demo_model(sys.argv[1], seed=0, **{TINY!r})")
    env = {**os.environ, "PYTHONHASHSEED": "12345", "OMP_NUM_THREADS": "1",
           "RAYON_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, env=env, timeout=120)
    assert digests(tmp_path) == digests(tiny_dir)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [({"num_layers": 2}, "num_layers"), ({"num_key_value_heads": 3}, "num_key_value_heads"),
     ({"vocab_size": 100}, "vocab_size"), ({"hidden_size": 0}, "hidden_size")],
)
def test_bad_overrides_name_the_field(tmp_path: Path, overrides: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        write_demo_model(tmp_path, **overrides)


def test_bad_seed_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="seed"):
        write_demo_model(tmp_path, seed=-1, **TINY)


def test_default_config_is_the_documented_one() -> None:
    c = DemoModelConfig()
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_attention_heads,
            c.num_key_value_heads, c.resolved_head_dim, c.intermediate_size) == (
            4096, 512, 12, 8, 4, 64, 1536)
    assert (c.max_position_embeddings, c.rope_theta, c.rms_norm_eps, c.tie_word_embeddings) == (
        4096, 10000.0, 1e-5, False)


# -- tokenizer ---------------------------------------------------------------------------------


def test_tokenizer_has_requested_size_and_special_ids() -> None:
    tok = build_tokenizer(4096)
    assert tok.get_vocab_size(with_added_tokens=True) == 4096
    assert [tok.token_to_id(t) for t in ("<unk>", "<s>", "</s>", "<pad>")] == [0, 1, 2, 3]
    # Trained merges make ordinary English compact.
    assert len(tok.encode("the system and the people", add_special_tokens=False).ids) == 5


def test_tokenizer_vocab_larger_than_corpus_supports_is_rejected() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(200_000)


# -- the full default model and its cache ------------------------------------------------------


def test_full_demo_model_loads_in_transformers_with_40m_params(full_dir: Path) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(full_dir)
    n_params = sum(p.numel() for p in model.parameters())
    assert 30e6 <= n_params <= 60e6
    assert model.config.num_key_value_heads == 4 and model.config.head_dim == 64
    assert set(load_file(full_dir / "model.safetensors")) == set(model.state_dict())


def test_hf_tokenizer_agrees_with_ours_on_the_full_model(full_dir: Path) -> None:
    ours = Tokenizer.from_pretrained(full_dir)
    hf_auto = transformers.AutoTokenizer.from_pretrained(full_dir)
    hf_file = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(full_dir / "tokenizer.json"), bos_token="<s>", eos_token="</s>",
        add_bos_token=True)
    for text in STRINGS:
        assert ours.encode(text) == hf_auto(text)["input_ids"] == hf_file(text)["input_ids"]
    chat = [{"role": "user", "content": "Hi there"}]
    assert ours.apply_chat_template(chat) == hf_auto.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True)
    hf_ids = hf_auto.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
    assert ours.encode_chat(chat) == list(getattr(hf_ids, "input_ids", hf_ids))


def test_ensure_demo_model_reuses_the_cached_copy(full_dir: Path) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in full_dir.iterdir()}
    assert ensure_demo_model(full_dir.parent) == full_dir
    assert {p.name: p.stat().st_mtime_ns for p in full_dir.iterdir()} == before
    assert [p.name for p in full_dir.parent.iterdir()] == [DEMO_MODEL_NAME]  # no temp dirs


def test_default_model_dir_honours_env_then_home(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", "/some/where")
    assert demo_model.default_model_dir() == Path("/some/where") / DEMO_MODEL_NAME
    monkeypatch.delenv("PDSERVE_CACHE_DIR")
    monkeypatch.setenv("HOME", "/home/someone")
    assert demo_model.default_model_dir() == Path(
        "/home/someone/.cache/pdserve") / DEMO_MODEL_NAME


def test_concurrent_materialize_has_one_winner_and_no_leftovers(tmp_path: Path) -> None:
    target = tmp_path / "model"
    n = 4
    barrier = threading.Barrier(n)  # every writer finishes before any rename: a real race
    results: list[Path] = []

    def writer(index: int):
        def write(tmp: Path) -> None:
            (tmp / "config.json").write_text(str(index))
            barrier.wait(timeout=30)
        return write

    def run(index: int) -> None:
        results.append(materialize_dir(target, writer(index), ("config.json",)))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == [target] * n
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    assert (target / "config.json").read_text() in {str(i) for i in range(n)}


def test_incomplete_cached_dir_is_reported_not_used(tmp_path: Path) -> None:
    (tmp_path / DEMO_MODEL_NAME).mkdir()
    (tmp_path / DEMO_MODEL_NAME / "config.json").write_text("{}")
    with pytest.raises(RuntimeError, match="model.safetensors"):
        ensure_demo_model(tmp_path)
