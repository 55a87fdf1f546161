"""pdserve.tokenizer and pdserve.detokenizer, on the demo byte-level BPE tokenizer."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models

from pdserve.demo_model import build_tokenizer, write_tokenizer_files
from pdserve.detokenizer import IncrementalDetokenizer
from pdserve.tokenizer import Tokenizer

SAMPLES = [
    "Hello, world!",
    "naïve café — déjà vu, Ångström, façade",
    "你好，世界。日本語のテキスト、한국어 문장",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flag 🇫🇷 heart ❤️",
    "combining: e\u0301 a\u0308 n\u0303 Z\u0351\u0352\u0353",
    "   leading and trailing spaces   ",
    "tabs\tand\nnewlines\r\n\n\n  indented\n\t\t\tdeep",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n",
    "zero\u200bwidth\u00a0nbsp\ufeffbom \U0010fffd \x00 \x7f",
    "",
]


def random_text(rng: random.Random, length: int) -> str:
    """Random Unicode scalar values (no surrogates), biased towards multi-byte characters."""
    pools = [(0x20, 0x7E), (0x80, 0x7FF), (0x800, 0xD7FF), (0xE000, 0xFFFD), (0x10000, 0x10FFFF)]
    chars = []
    for _ in range(length):
        if rng.random() < 0.15:
            chars.append(rng.choice(" \n\t  "))
            continue
        lo, hi = rng.choice(pools)
        chars.append(chr(rng.randint(lo, hi)))
    return "".join(chars)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_files(tmp_path_factory.mktemp("tok"), vocab_size=4096)


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(model_dir)


# -- encode / decode ---------------------------------------------------------------------------


@pytest.mark.parametrize("text", SAMPLES)
def test_utf8_samples_round_trip_exactly(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_random_code_points_round_trip_exactly(tok: Tokenizer) -> None:
    rng = random.Random(7)
    for _ in range(50):
        text = random_text(rng, rng.randint(1, 60))
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_encode_adds_bos_once_and_decode_skips_it(tok: Tokenizer) -> None:
    ids = tok.encode("hello there")
    assert tok.bos_token_id == 1
    assert ids[0] == tok.bos_token_id and ids[1:] == tok.encode("hello there", False)
    assert ids.count(tok.bos_token_id) == 1
    assert tok.decode(ids) == "hello there"
    assert tok.decode(ids, skip_special_tokens=False) == "<s>hello there"


def test_vocabulary_facts(tok: Tokenizer) -> None:
    assert tok.vocab_size == 4096
    assert tok.eos_token_ids == frozenset({2})
    assert tok.pad_token_id == 3
    assert tok.convert_ids_to_tokens([1, 2]) == ["<s>", "</s>"]
    assert tok.token_to_id("<unk>") == 0 and tok.id_to_token(0) == "<unk>"


def test_encode_rejects_non_string(tok: Tokenizer) -> None:
    with pytest.raises(TypeError, match="text"):
        tok.encode(b"bytes")  # type: ignore[arg-type]


def _tokenizer_dir(tmp_path: Path, config: dict, post_processor: bool = True) -> Path:
    backend = build_tokenizer(512)
    if not post_processor:
        data = json.loads(backend.to_str())
        data["post_processor"] = None
        backend = BackendTokenizer.from_str(json.dumps(data))
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def test_explicit_add_bos_false_and_add_eos_true_are_obeyed(tmp_path: Path) -> None:
    cfg = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False, "add_eos_token": True}
    tok = Tokenizer.from_pretrained(_tokenizer_dir(tmp_path, cfg))
    assert tok.encode("ab") == tok.encode("ab", add_special_tokens=False) + [2]


def test_bos_is_added_by_default_without_post_processor(tmp_path: Path) -> None:
    cfg = {"bos_token": {"__type": "AddedToken", "content": "<s>"}, "eos_token": "</s>"}
    tok = Tokenizer.from_pretrained(_tokenizer_dir(tmp_path, cfg, post_processor=False))
    assert tok.encode("ab") == [1] + tok.encode("ab", add_special_tokens=False)


def test_no_bos_token_means_no_bos(tmp_path: Path) -> None:
    tok = Tokenizer.from_pretrained(_tokenizer_dir(tmp_path, {}, post_processor=False))
    assert tok.bos_token_id is None
    assert tok.encode("ab") == tok.encode("ab", add_special_tokens=False)


def test_eos_ids_merge_tokenizer_generation_and_model_configs(tmp_path: Path) -> None:
    _tokenizer_dir(tmp_path, {"eos_token": "</s>"})
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert Tokenizer.from_pretrained(tmp_path).eos_token_ids == frozenset({2, 7, 9})


def test_bad_eos_id_in_config_names_the_field(tmp_path: Path) -> None:
    _tokenizer_dir(tmp_path, {"eos_token": "</s>"})
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": "two"}))
    with pytest.raises(ValueError, match="eos_token_id"):
        Tokenizer.from_pretrained(tmp_path)


def test_missing_tokenizer_json_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)


def test_unknown_special_token_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="eos_token"):
        Tokenizer.from_pretrained(_tokenizer_dir(tmp_path, {"eos_token": "<|nope|>"}))


# -- chat template -----------------------------------------------------------------------------

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi 😀"},
]


def test_chat_template_renders_roles_and_generation_prompt(tok: Tokenizer) -> None:
    expected = "<s><|system|>\nBe brief.</s>\n<|user|>\nHi 😀</s>\n"
    assert tok.apply_chat_template(CHAT, add_generation_prompt=False) == expected
    assert tok.apply_chat_template(CHAT) == expected + "<|assistant|>\n"


def test_encode_chat_does_not_double_bos(tok: Tokenizer) -> None:
    ids = tok.encode_chat(CHAT)
    assert ids[0] == 1 and ids.count(1) == 1
    assert tok.decode(ids, skip_special_tokens=False) == tok.apply_chat_template(CHAT)


def test_template_raise_exception_becomes_value_error(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="unsupported role: tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


@pytest.mark.parametrize(
    ("messages", "field"),
    [("hi", "messages"), ([["user", "hi"]], r"messages\[0\]"), ([{"content": "x"}], "role")],
)
def test_malformed_messages_name_the_field(tok: Tokenizer, messages: object, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        tok.apply_chat_template(messages)  # type: ignore[arg-type]


def test_model_without_template_is_a_clear_error(tmp_path: Path) -> None:
    tok = Tokenizer.from_pretrained(_tokenizer_dir(tmp_path, {"bos_token": "<s>"}))
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template(CHAT)


def test_chat_template_file_features_and_sandbox(tmp_path: Path) -> None:
    _tokenizer_dir(tmp_path, {"bos_token": "<s>", "chat_template": "ignored: the file wins"})
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{% generation %}{{ m | tojson }}{% endgeneration %}"
        "{% if loop.index == 1 %}{% break %}{% endif %}{% endfor %}{{ extra }}"
    )
    tok = Tokenizer.from_pretrained(tmp_path)
    messages = [{"role": "user", "content": "<b>&é"}, {"role": "user", "content": "x"}]
    assert tok.apply_chat_template(messages, extra="!") == (
        '{"role": "user", "content": "<b>&é"}!')

    (tmp_path / "chat_template.jinja").write_text("{% set _ = messages.append(1) %}")
    with pytest.raises(ValueError, match="chat template failed"):
        Tokenizer.from_pretrained(tmp_path).apply_chat_template(messages)


def test_named_chat_templates_use_the_default(tmp_path: Path) -> None:
    templates = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    tok = Tokenizer.from_pretrained(_tokenizer_dir(tmp_path, {"chat_template": templates}))
    assert tok.apply_chat_template(CHAT) == "D"


# -- incremental detokenizer -------------------------------------------------------------------


def stream(det: IncrementalDetokenizer, ids: list[int], rng: random.Random | None = None) -> list:
    """Feed ids one at a time (or in random chunks of 1-4); return every delta, flush included."""
    deltas, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 4) if rng else 1
        deltas.append(det.add(ids[i:i + n]))
        i += n
    deltas.append(det.flush())
    return deltas


@pytest.mark.parametrize("text", SAMPLES)
def test_streamed_valid_text_equals_full_decode_without_replacement_chars(
    tok: Tokenizer, text: str
) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    det = IncrementalDetokenizer(tok, [])
    deltas = stream(det, ids)
    assert deltas[-1] == ""  # nothing was left held back
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == det.text == text


def test_random_ids_stream_equals_full_decode(tok: Tokenizer) -> None:
    rng = random.Random(3)
    for skip in (True, False):
        for _ in range(30):
            ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 40))]
            det = IncrementalDetokenizer(tok, [], skip_special_tokens=skip)
            deltas = stream(det, ids, rng)
            assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)


def test_split_character_is_held_back_until_complete(tok: Tokenizer) -> None:
    # Find a character that the tokenizer splits over several tokens.
    char = next(c for c in "😀🦀𝄞" if len(tok.encode(c, add_special_tokens=False)) > 1)
    ids = tok.encode("a" + char, add_special_tokens=False)
    det = IncrementalDetokenizer(tok, [])
    deltas = [det.add([i]) for i in ids]
    assert "".join(deltas) == "a" + char
    assert deltas[-1].endswith(char) and "" in deltas[1:-1]
    assert not det.has_pending


def test_prompt_prefix_gives_the_same_output_text(tok: Tokenizer) -> None:
    rng = random.Random(11)
    for _ in range(20):
        prompt = tok.encode(random_text(rng, 20))
        output = tok.encode(random_text(rng, 30), add_special_tokens=False) + [2]
        det = IncrementalDetokenizer(tok, prompt)
        assert "".join(stream(det, output, rng)) == tok.decode(output)


def test_prompt_ending_inside_a_character_completes_it_in_the_output(tok: Tokenizer) -> None:
    char = next(c for c in "😀🦀𝄞" if len(tok.encode(c, add_special_tokens=False)) > 1)
    ids = tok.encode("x" + char + "y", add_special_tokens=False)
    split = len(tok.encode("x", add_special_tokens=False)) + 1  # inside the character
    det = IncrementalDetokenizer(tok, ids[:split])
    assert "".join(stream(det, ids[split:])) == char + "y"


def test_window_stays_small_on_long_outputs(tok: Tokenizer) -> None:
    decoded_lengths: list[int] = []

    class CountingTokenizer:
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            decoded_lengths.append(len(ids))
            return tok.decode(ids, skip_special_tokens)

    text = " ".join(SAMPLES) * 20
    ids = tok.encode(text, add_special_tokens=False)
    det = IncrementalDetokenizer(CountingTokenizer(), tok.encode("prompt"))  # type: ignore[arg-type]
    assert "".join(stream(det, ids)) == text
    assert len(ids) > 1000 and max(decoded_lengths) <= 12


def test_leading_space_of_first_output_word_survives_a_stripping_decoder() -> None:
    # SentencePiece-style: the decoder drops the leading space of the first token it sees.
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3}
    backend = BackendTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.decoder = decoders.Metaspace()
    tok = Tokenizer(backend)
    assert tok.decode([2]) == "world"
    det = IncrementalDetokenizer(tok, [1])
    assert [det.add([2]), det.add([3])] == [" world", "!"]
    assert det.text == " world!"
