"""The tokenizer built from a GGUF's metadata encodes, decodes and renders chat prompts like
transformers' own GGUF tokenizer (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pdserve.engine.checkpoint import open_checkpoint
from pdserve.engine.checkpoint.gguf_tokenizer import byte_alphabet
from tests.helpers.gguf_files import (
    byte_level_vocab,
    hf_gguf_tokenizer,
    sentencepiece_vocab,
    write_gguf,
)

pytest.importorskip("gguf")

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. Then the fox ran away!",
    "  leading spaces and\ttabs\n\nnew lines  ",
    "I'm sure they'll say it's fine, don't you think? We've seen it.",
    "<s> special </s> tokens <unk> inline, and <pad> too",
    "Le café est très bon à Paris, n'est-ce pas ? 你好，世界。😀 — “quotes”",
    "def f(x):\n    return x ** 2  # the square\n",
]
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And of Spain?"}]
HPARAMS = {"context_length": 64, "embedding_length": 64, "block_count": 1,
           "feed_forward_length": 128, "attention.head_count": 4, "attention.head_count_kv": 2,
           "attention.layer_norm_rms_epsilon": 1e-5, "rope.freq_base": 10000.0}


def _file(path: Path, vocab: dict, **kw) -> Path:
    from pdserve.demo_model import CHAT_TEMPLATE

    emb = np.zeros((len(vocab["tokens"]), 64), np.float32)
    return write_gguf(path, "llama", HPARAMS, [("token_embd.weight", emb, "F32")], vocab,
                      chat_template=CHAT_TEMPLATE, **kw)


@pytest.fixture(scope="module")
def vocab_dir(tmp_path_factory) -> Path:
    from pdserve.demo_model import write_tokenizer_files

    return write_tokenizer_files(tmp_path_factory.mktemp("tok"), vocab_size=1024)


def assert_same_tokenizer(ours, theirs, texts=TEXTS) -> None:
    for text in texts:
        ids = theirs(text).input_ids
        assert ours.encode(text) == ids, text
        assert ours.encode(text, add_special_tokens=False) == theirs(
            text, add_special_tokens=False).input_ids, text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids), text
    rendered = theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(MESSAGES) == rendered
    assert ours.encode_chat(MESSAGES) == theirs(rendered, add_special_tokens=False).input_ids


# SmolLM's digit split is tested on the real file (tests/pdserve/test_default_model.py): with
# this tiny vocabulary's digit merges it differs from transformers' converter, by design.
@pytest.mark.parametrize("pre", ["gpt2", "llama-bpe", "qwen2"])
def test_byte_level_bpe_matches_transformers(tmp_path, vocab_dir, pre):
    path = _file(tmp_path / "t.gguf", byte_level_vocab(vocab_dir), pre=pre)
    assert_same_tokenizer(open_checkpoint(path).tokenizer(), hf_gguf_tokenizer(path))


@pytest.mark.parametrize("add_bos", [True, False])
def test_bos_follows_the_file_flag(tmp_path, vocab_dir, add_bos):
    path = _file(tmp_path / "t.gguf", byte_level_vocab(vocab_dir), special={
        "bos_token_id": 1, "eos_token_id": 2, "add_bos_token": add_bos})
    ours, theirs = open_checkpoint(path).tokenizer(), hf_gguf_tokenizer(path)
    assert ours.encode("Hello")[0] == 1 if add_bos else ours.encode("Hello")[0] != 1
    assert ours.encode("Hello") == theirs("Hello").input_ids


def test_sentencepiece_bpe_with_byte_fallback_matches_transformers(tmp_path):
    path = _file(tmp_path / "spm.gguf", sentencepiece_vocab(), special={
        "bos_token_id": 1, "eos_token_id": 2, "unknown_token_id": 0})
    ours, theirs = open_checkpoint(path).tokenizer(), hf_gguf_tokenizer(path)
    assert_same_tokenizer(ours, theirs, [*TEXTS, "Ünïcödé ∑ outside the vocabulary → bytes"])
    assert ours.encode("hi")[0] == 1  # llama files add BOS unless they say otherwise


def test_control_tokens_are_special_and_user_defined_ones_stay_whole(tmp_path, vocab_dir):
    vocab = byte_level_vocab(vocab_dir)
    vocab["types"] = list(vocab["types"])
    user = next(i for i, t in enumerate(vocab["tokens"]) if len(t) > 4 and t.isalpha())
    vocab["types"][user] = 4  # USER_DEFINED
    ours = open_checkpoint(_file(tmp_path / "t.gguf", vocab)).tokenizer()
    word = vocab["tokens"][user]
    assert ours.encode(f"x{word}y", add_special_tokens=False).count(user) == 1
    assert ours.decode(ours.encode("a </s> b")) == "a  b"  # control: dropped when decoding
    assert ours.eos_token_ids == frozenset({2}) and ours.bos_token == "<s>"


def test_tokens_outside_the_byte_alphabet_are_respelled(tmp_path, vocab_dir):
    vocab = byte_level_vocab(vocab_dir)
    vocab["tokens"] = list(vocab["tokens"])
    vocab["tokens"][3] = "<pad token>"  # a raw space, as some converters write special tokens
    ours = open_checkpoint(_file(tmp_path / "t.gguf", vocab)).tokenizer()
    spelled = "<pad" + byte_alphabet()[ord(" ")] + "token>"
    assert ours.token_to_id(spelled) == 3


def test_saved_tokenizer_files_load_to_the_same_tokenizer(tmp_path, vocab_dir):
    from pdserve.tokenizer import Tokenizer

    built = open_checkpoint(_file(tmp_path / "t.gguf", byte_level_vocab(vocab_dir))).tokenizer()
    loaded = Tokenizer.from_pretrained(built.save_pretrained(tmp_path / "saved"))
    for text in TEXTS:
        assert loaded.encode(text) == built.encode(text)
    assert loaded.encode_chat(MESSAGES) == built.encode_chat(MESSAGES)
    assert (loaded.eos_token_ids, loaded.bos_token_id, loaded.pad_token_id) == (
        built.eos_token_ids, built.bos_token_id, built.pad_token_id)
