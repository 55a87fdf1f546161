"""The random demo model: a small random-weight Llama checkpoint in Hugging Face format, for
tests and for benches that need speed rather than meaning (the served default is a real model:
pdserve/default_model.py).

Owns the demo model's configuration (`DemoModelConfig`), its deterministic weights, its byte-level
BPE tokenizer (trained in code on a corpus generated in code, so nothing is downloaded), and its
on-disk cache (`ensure_demo_model`, used by the benches).

Everything written is a pure function of (seed, config): the same inputs give byte-identical files,
so every process of a cluster that builds the demo model on its own gets the same model. Whenever
the bytes written for the default config change, bump `DEMO_MODEL_NAME`, so that caches built by
an older version are not reused.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import random
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

if TYPE_CHECKING:
    import torch

DEMO_MODEL_NAME = "demo-llama-40m-v1"
CACHE_DIR_ENV = "PDSERVE_CACHE_DIR"

UNK_TOKEN, BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<unk>", "<s>", "</s>", "<pad>"
# Trained first, so they get ids 0..3 (Llama's unk=0, bos=1, eos=2 layout).
SPECIAL_TOKENS = (UNK_TOKEN, BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)
# 256 byte symbols + the special tokens: no byte-level vocabulary can be smaller.
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

# Role markers are plain text (not special tokens), so user text can never forge them as ids.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unsupported role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

_MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


@dataclass(frozen=True)
class DemoModelConfig:
    """Shape of the demo Llama model; the defaults are the embedded demo model (~42M params)."""

    vocab_size: int = 4096
    """Rows of the embedding and of lm_head; the tokenizer is trained to exactly this size."""
    hidden_size: int = 512
    intermediate_size: int = 1536
    num_hidden_layers: int = 12
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    """Fewer KV heads than query heads: the demo model exercises GQA."""
    head_dim: int | None = None
    """None means hidden_size // num_attention_heads; always written explicitly to config.json."""
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    """Standard deviation of the normal init of every matrix."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.vocab_size, int) or self.vocab_size < MIN_VOCAB_SIZE:
            raise ValueError(
                f"vocab_size must be an int >= {MIN_VOCAB_SIZE}, got {self.vocab_size!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError("head_dim must be given when hidden_size is not a multiple of "
                             "num_attention_heads")
        if self.head_dim is not None and (self.head_dim <= 0 or self.head_dim % 2):
            raise ValueError(f"head_dim must be a positive even int (RoPE), got {self.head_dim!r}")
        for name in ("rope_theta", "rms_norm_eps", "initializer_range"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else (
            self.hidden_size // self.num_attention_heads)

    def to_hf_config(self) -> dict:
        """The config.json dict, in the classic Llama layout that every HF version reads."""
        bos, eos, pad = (SPECIAL_TOKENS.index(t) for t in (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN))
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.resolved_head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "rms_norm_eps": self.rms_norm_eps,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "mlp_bias": False,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.initializer_range,
            "bos_token_id": bos,
            "eos_token_id": eos,
            "pad_token_id": pad,
            "torch_dtype": "float32",
            "use_cache": True,
        }


def make_config(**overrides: object) -> DemoModelConfig:
    """The default demo config with some fields replaced; an unknown field is a ValueError."""
    known = {f.name for f in dataclasses.fields(DemoModelConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown demo model config field(s): {', '.join(unknown)}")
    return DemoModelConfig(**overrides)


# ---------------------------------------------------------------------------------------------
# Weights


def build_weights(config: DemoModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random fp32 weights with HF Llama parameter names, a pure function of (config, seed)."""
    import torch  # here, not at the top: the router reads this module's paths, not weights

    gen = torch.Generator(device="cpu").manual_seed(seed)
    std = config.initializer_range
    # GPT-2 style: shrink the residual-branch outputs so activations do not grow with depth.
    out_std = std / math.sqrt(2 * config.num_hidden_layers)
    h, inter, hd = config.hidden_size, config.intermediate_size, config.resolved_head_dim
    q_out, kv_out = config.num_attention_heads * hd, config.num_key_value_heads * hd

    def normal(rows: int, cols: int, scale: float) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen, dtype=torch.float32).mul_(scale)

    weights = {"model.embed_tokens.weight": normal(config.vocab_size, h, std)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        weights[p + "self_attn.q_proj.weight"] = normal(q_out, h, std)
        weights[p + "self_attn.k_proj.weight"] = normal(kv_out, h, std)
        weights[p + "self_attn.v_proj.weight"] = normal(kv_out, h, std)
        weights[p + "self_attn.o_proj.weight"] = normal(h, q_out, out_std)
        weights[p + "mlp.gate_proj.weight"] = normal(inter, h, std)
        weights[p + "mlp.up_proj.weight"] = normal(inter, h, std)
        weights[p + "mlp.down_proj.weight"] = normal(h, inter, out_std)
        weights[p + "input_layernorm.weight"] = torch.ones(h)
        weights[p + "post_attention_layernorm.weight"] = torch.ones(h)
    weights["model.norm.weight"] = torch.ones(h)
    if not config.tie_word_embeddings:
        weights["lm_head.weight"] = normal(config.vocab_size, h, std)
    return weights


# ---------------------------------------------------------------------------------------------
# Tokenizer


def build_tokenizer(vocab_size: int = 4096) -> Tokenizer:
    """A byte-level BPE tokenizer of `vocab_size` tokens (specials included) trained in code.

    Any UTF-8 text round-trips exactly (no normalizer, byte-level alphabet). Encoding adds `<s>`.
    Raises ValueError if the built-in corpus cannot yield that many tokens.
    """
    tokenizer = Tokenizer.from_str(_trained_tokenizer_json(vocab_size))
    if tokenizer.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise ValueError(
            f"vocab_size {vocab_size} is larger than the demo corpus supports "
            f"(got {tokenizer.get_vocab_size(with_added_tokens=True)} tokens)"
        )
    return tokenizer


# Memoised as an immutable JSON string (never a shared mutable Tokenizer): training takes about a
# second, and tests build many tiny checkpoints with the same vocabulary size.
@functools.lru_cache(maxsize=8)
def _trained_tokenizer_json(vocab_size: int) -> str:
    if not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be an int >= {MIN_VOCAB_SIZE}, got {vocab_size!r}")
    tokenizer = Tokenizer(models.BPE())
    # add_prefix_space=False: a leading space would break exact round-trips.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus_lines(), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN}:0 $A:0", pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tokenizer.to_str()


def tokenizer_config(model_max_length: int = DemoModelConfig.max_position_embeddings) -> dict:
    """tokenizer_config.json for the demo tokenizer (read by pdserve and by transformers)."""
    return {
        # The generic fast class: the Llama class would rebuild a SentencePiece-style tokenizer.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": UNK_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }


def write_tokenizer_files(
    out_dir: str | Path,
    vocab_size: int = 4096,
    model_max_length: int = DemoModelConfig.max_position_embeddings,
) -> Path:
    """Write tokenizer.json and tokenizer_config.json of the demo tokenizer into out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(vocab_size).save(str(out / "tokenizer.json"), pretty=False)
    _write_json(out / "tokenizer_config.json", tokenizer_config(model_max_length))
    return out


# Words and fragments the corpus is built from. The mix (prose, code, numbers, chat markers,
# a few other scripts) gives merges for the text a demo server typically sees.
_WORDS = """
the of and to in is that for it as was with be by on not he this are or his from at which but
have an they you were her she there been one all we their has would when if so no will more can
out other into up some could them than then these its about over two time only may new like also
now our first any very after what people where man most years made way see make your many said
did back just such because use even through work well much how down should own world life know
those day same three each here still last good long must while great old year might place
between never both under again being come state take every part before think right going high
another system small found give case came house set end against point number course without
thing often help however group public fact home left different during early later form order
real hand large little general become less want need keep present since mean water light city
river tree music story model token server request stream cache block layer decode prefill batch
queue worker router memory speed value error result table query index hello thanks please
question answer language machine learning data file line word text list string function class
""".split()

_CODE_WORDS = """
def return import from class self None True False for while if elif else try except finally
with as yield lambda async await print range len dict list tuple set int str float bool
""".split()

_CONSONANTS = "b c d f g h k l m n p r s t v w z ch sh th st tr pl gr br qu".split()
_VOWELS = "a e i o u y ai ea ou io ee".split()

_FOREIGN = (
    "Le café est très bon à Paris, n'est-ce pas ? Où est la bibliothèque ?",
    "Über die Brücke gehen wir schnell. Größe, Straße, Mädchen, schön.",
    "El niño está en la montaña. ¿Dónde está el baño? Mañana será mejor.",
    "你好，世界。今天天气很好。我们一起去学习语言模型吧。",
    "こんにちは、世界。これは日本語の文章です。ありがとうございます。",
    "Привет, мир! Как дела? Это пример текста на русском языке.",
    "안녕하세요 세계. 오늘은 좋은 날입니다.",
    "😀 😂 👍 🎉 🚀 ❤️ ✨ 🔥 🙏 😊 — “quotes” ‘single’ … • → ← ≤ ≥ ± × ÷ € £ ¥",
)


def _corpus_lines(seed: int = 20240601, n_sentences: int = 6000) -> Iterator[str]:
    """A fixed, generated training corpus (~0.4 MB): the same lines on every run and platform.

    random.Random with an int seed and choice/randint are stable across Python versions.
    """
    rng = random.Random(seed)
    for i in range(n_sentences):
        kind = i % 6
        if kind < 3:
            yield _prose_line(rng)
        elif kind == 3:
            yield _code_line(rng)
        elif kind == 4:
            yield _number_line(rng)
        else:
            yield _chat_line(rng) if i % 12 == 5 else _FOREIGN[(i // 6) % len(_FOREIGN)] + "\n"


def _pseudo_word(rng: random.Random) -> str:
    return "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(rng.randint(1, 4)))


def _word(rng: random.Random) -> str:
    return rng.choice(_WORDS) if rng.random() < 0.75 else _pseudo_word(rng)


def _prose_line(rng: random.Random) -> str:
    words = [_word(rng) for _ in range(rng.randint(4, 16))]
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice((".", ".", ".", "?", "!", ",", ";", ":")) + "\n"


def _identifier(rng: random.Random) -> str:
    parts = [_word(rng) for _ in range(rng.randint(1, 3))]
    if rng.random() < 0.3:
        return parts[0] + "".join(p.capitalize() for p in parts[1:])
    return "_".join(parts)


def _code_line(rng: random.Random) -> str:
    a, b, c = _identifier(rng), _identifier(rng), _identifier(rng)
    n = rng.randint(0, 1000)
    templates = (
        f"def {a}({b}, {c}=None):\n    return {b} + {n}\n",
        f"    for {b} in range({n}):\n        {a}.append({b} * 2)\n",
        f"        if {a} == {n} and not {b}:\n            raise ValueError(\"bad {c}\")\n",
        f"class {a.title().replace('_', '')}:\n    {b}: int = {n}\n",
        f"{a} = {{\"{b}\": {n}, \"{c}\": [{n}, {n + 1}]}}\n",
        f"    {a} = self.{b}[{n}:] if {c} is not None else []  # {_word(rng)} {_word(rng)}\n",
        f"import {a}\nfrom {b} import {c}\n",
        f"\tprint(f\"{{{a}}} {rng.choice(_CODE_WORDS)} {n}\")\n",
        "    " + " ".join(rng.choice(_CODE_WORDS) for _ in range(rng.randint(3, 8))) + ":\n",
    )
    return rng.choice(templates)


def _number_line(rng: random.Random) -> str:
    return (
        f"{rng.randint(1, 31):02d}/{rng.randint(1, 12):02d}/{rng.randint(1900, 2100)} "
        f"{rng.randint(0, 99999)} {rng.random() * 1000:.3f} {rng.randint(-500, 500)} "
        f"0x{rng.randint(0, 65535):04x} {_word(rng)} {rng.randint(0, 100)}%\n"
    )


def _chat_line(rng: random.Random) -> str:
    user = " ".join(_word(rng) for _ in range(rng.randint(3, 10)))
    reply = " ".join(_word(rng) for _ in range(rng.randint(3, 10)))
    return f"<|user|>\n{user}?{EOS_TOKEN}\n<|assistant|>\n{reply}.{EOS_TOKEN}\n"


# ---------------------------------------------------------------------------------------------
# Checkpoint files and the cache


def write_demo_model(out_dir: str | Path, seed: int = 0, **overrides: object) -> Path:
    """Write a random-weight Llama checkpoint in HF format into out_dir and return its path.

    overrides replace DemoModelConfig fields (e.g. num_hidden_layers=2, hidden_size=64) to build
    a smaller variant; the same (seed, overrides) always writes byte-identical files.
    """
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
        raise ValueError(f"seed must be an int in [0, 2**63), got {seed!r}")
    config = make_config(**overrides)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_config = config.to_hf_config()
    _write_json(out / "config.json", hf_config)
    _write_json(out / "generation_config.json", {
        "_from_model_config": False,
        "bos_token_id": hf_config["bos_token_id"],
        "eos_token_id": hf_config["eos_token_id"],
        "pad_token_id": hf_config["pad_token_id"],
    })
    write_tokenizer_files(out, config.vocab_size, config.max_position_embeddings)
    from safetensors.torch import save_file

    save_file(build_weights(config, seed), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


def default_model_dir(cache_dir: str | Path | None = None) -> Path:
    """Where the demo model is cached: cache_dir, else $PDSERVE_CACHE_DIR, else ~/.cache/pdserve."""
    if cache_dir is None:
        cache_dir = os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "pdserve"
    return Path(cache_dir) / DEMO_MODEL_NAME


def ensure_demo_model(cache_dir: str | Path | None = None) -> Path:
    """Return the cached default demo model's directory, writing it first if it is missing.

    Safe when several processes call it at once: each writes a private temp dir and renames it
    into place; the losers of the race use the winner's (identical) copy.
    """
    return materialize_dir(default_model_dir(cache_dir), write_demo_model, _MODEL_FILES)


def materialize_dir(
    target: Path, write: Callable[[Path], object], required: tuple[str, ...]
) -> Path:
    """Create `target` atomically with `write(tmp_dir)` unless it already exists complete."""
    if target.is_dir():
        return _check_complete(target, required)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Beside the target, so the rename stays on one filesystem and is atomic.
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        write(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the cache may be shared read-only
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process renamed its copy first (the target is a non-empty dir now).
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _check_complete(target, required)


def _check_complete(target: Path, required: tuple[str, ...]) -> Path:
    missing = [name for name in required if not (target / name).is_file()]
    if missing:
        raise RuntimeError(
            f"{target} exists but lacks {', '.join(missing)}; delete the directory to rebuild it"
        )
    return target


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
