"""A fast Hugging Face tokenizer built from a GGUF file's `tokenizer.ggml.*` metadata.

A GGUF has no tokenizer.json: it stores the vocabulary (`tokens`, with a `token_type` each),
the BPE `merges` or SentencePiece `scores`, the special token ids, the add-BOS/EOS flags and
the chat template. `tokenizer.ggml.model` names the algorithm:

- `gpt2`: byte-level BPE. The vocabulary is in GPT-2's byte alphabet; `tokenizer.ggml.pre`
  names the split before BPE (`PRE_TOKENIZERS`: the GPT-2 regex, Llama 3's, Qwen2's, or
  SmolLM/StarCoder's "each digit alone, then GPT-2"). An unknown `pre` is refused.
- `llama`: SentencePiece BPE with byte fallback (Llama 2, Mistral). Merges are recovered from
  the scores: every split of a token into two vocabulary tokens is a merge, ranked by the
  token's score, exactly as transformers' GGUF converter ranks them.

Token types: CONTROL tokens become special added tokens (never split, dropped when decoding
with skip_special_tokens), USER_DEFINED ones plain added tokens. BOS is added when
`add_bos_token` says so (default: yes for `llama`, no for `gpt2`), as transformers does.

Where the model's own tokenizer and transformers' GGUF converter differ, this follows the
model's (as llama.cpp does): SmolLM's digits are split one by one before the GPT-2 regex, and
Llama 3's vocabulary is looked up whole before merging (`ignore_merges`). See
docs/architecture.md ("Checkpoints") for the cases where that changes a tokenisation.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from pdserve.tokenizer import Tokenizer


class TokenType(enum.IntEnum):
    """llama.cpp's `llama_token_type` (tokenizer.ggml.token_type)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class PreTokenizer:
    """How a byte-level vocabulary splits text before BPE."""

    split: str | None
    """A regex whose matches are the pieces (None: GPT-2's, inside ByteLevel)."""
    digits: bool = False
    """Each digit is its own piece first (SmolLM, StarCoder)."""
    ignore_merges: bool = False
    """A piece that is a vocabulary token is taken whole (Llama 3)."""

    def build(self) -> pre_tokenizers.PreTokenizer:
        steps = []
        if self.digits:
            steps.append(pre_tokenizers.Digits(individual_digits=True))
        if self.split is not None:
            steps.append(pre_tokenizers.Split(Regex(self.split), behavior="isolated"))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False,
                                              use_regex=self.split is None))
        return steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)


_GPT2 = PreTokenizer(None)
_LLAMA3 = PreTokenizer(_LLAMA3_SPLIT, ignore_merges=True)
_QWEN2 = PreTokenizer(_QWEN2_SPLIT)
_DIGITS_GPT2 = PreTokenizer(None, digits=True)
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "gpt2": _GPT2, "gpt-2": _GPT2,
    "llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "falcon3": _LLAMA3,
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2,
    "smollm": _DIGITS_GPT2, "starcoder": _DIGITS_GPT2, "refact": _DIGITS_GPT2,
}


@dataclass(frozen=True)
class GGUFVocab:
    """The tokenizer part of a GGUF file's metadata."""

    model: str
    tokens: Sequence[str]
    token_types: Sequence[int]
    merges: Sequence[str] | None = None
    scores: Sequence[float] | None = None
    pre: str | None = None
    bos_id: int | None = None
    eos_id: int | None = None
    unk_id: int | None = None
    pad_id: int | None = None
    add_bos: bool | None = None
    add_eos: bool | None = None
    add_space_prefix: bool | None = None
    chat_template: str | None = None
    extra_eos_ids: tuple[int, ...] = ()
    """End-of-generation ids besides EOS (tokenizer.ggml.eot_token_id / eom_token_id)."""

    @classmethod
    def from_metadata(cls, meta: Mapping[str, object], arrays: Mapping[str, Sequence]
                      ) -> GGUFVocab:
        """`meta`: scalar `tokenizer.*` fields; `arrays`: tokens, token_type, merges, scores."""
        def opt(key: str):
            return meta.get(f"tokenizer.ggml.{key}")

        model = opt("model")
        if not isinstance(model, str) or "tokens" not in arrays:
            raise ValueError("GGUF file has no tokenizer (tokenizer.ggml.model / tokens)")
        tokens = list(arrays["tokens"])
        extra = tuple(int(i) for i in (opt("eot_token_id"), opt("eom_token_id"))
                      if isinstance(i, int))
        return cls(
            model=model, tokens=tokens,
            token_types=list(arrays.get("token_type") or [TokenType.NORMAL] * len(tokens)),
            merges=arrays.get("merges"), scores=arrays.get("scores"), pre=opt("pre"),
            bos_id=opt("bos_token_id"), eos_id=opt("eos_token_id"),
            unk_id=opt("unknown_token_id"), pad_id=opt("padding_token_id"),
            add_bos=opt("add_bos_token"), add_eos=opt("add_eos_token"),
            add_space_prefix=opt("add_space_prefix"),
            chat_template=meta.get("tokenizer.chat_template"), extra_eos_ids=extra)

    def check_id(self, token_id: int | None) -> None:
        if token_id is not None and not 0 <= token_id < len(self.tokens):
            raise ValueError(f"GGUF special token id {token_id} is outside the vocabulary of "
                             f"{len(self.tokens)}")


def build_tokenizer(vocab: GGUFVocab) -> Tokenizer:
    """The `Tokenizer` a GGUF vocabulary describes; ValueError for one it cannot build exactly."""
    if vocab.model == "gpt2":
        backend = _byte_level(vocab)
        add_bos = bool(vocab.add_bos)
    elif vocab.model == "llama":
        backend = _sentencepiece(vocab)
        add_bos = True if vocab.add_bos is None else bool(vocab.add_bos)
    else:
        raise ValueError(f"GGUF tokenizer model {vocab.model!r} is not supported "
                         "(supported: gpt2, llama)")
    _add_special_tokens(backend, vocab)

    def token(token_id: int | None) -> str | None:  # as the backend spells it
        vocab.check_id(token_id)
        return None if token_id is None else backend.id_to_token(token_id)

    return Tokenizer(
        backend, bos_token=token(vocab.bos_id), eos_token=token(vocab.eos_id),
        pad_token=token(vocab.pad_id), unk_token=token(vocab.unk_id),
        add_bos_token=add_bos, add_eos_token=bool(vocab.add_eos),
        chat_template=vocab.chat_template, extra_eos_token_ids=vocab.extra_eos_ids)


def _byte_level(vocab: GGUFVocab) -> tokenizers.Tokenizer:
    if vocab.pre not in PRE_TOKENIZERS:
        raise ValueError(f"GGUF tokenizer.ggml.pre {vocab.pre!r} is not supported (supported: "
                         f"{', '.join(sorted(PRE_TOKENIZERS))})")
    if vocab.merges is None:
        raise ValueError("GGUF gpt2 tokenizer has no tokenizer.ggml.merges")
    pre = PRE_TOKENIZERS[vocab.pre]
    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    # Tokens outside the byte alphabet (a few special tokens) are respelled byte by byte, as
    # transformers does, so every vocabulary entry is reachable.
    ids = {(t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode())): i
           for i, t in enumerate(vocab.tokens)}
    merges = [tuple(m.split(" ", 1)) for m in vocab.merges]
    backend = tokenizers.Tokenizer(models.BPE(
        ids, merges, dropout=None, continuing_subword_prefix="", end_of_word_suffix="",
        fuse_unk=False, ignore_merges=pre.ignore_merges))
    backend.pre_tokenizer = pre.build()
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece(vocab: GGUFVocab) -> tokenizers.Tokenizer:
    if vocab.scores is None:
        raise ValueError("GGUF llama tokenizer has no tokenizer.ggml.scores")
    ids = {t: i for i, t in enumerate(vocab.tokens)}
    merges = merges_from_scores(ids, dict(zip(vocab.tokens, vocab.scores, strict=True)))
    backend = tokenizers.Tokenizer(models.BPE(ids, merges, fuse_unk=True, byte_fallback=True,
                                              dropout=None))
    prefix = vocab.add_space_prefix is not False
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def merges_from_scores(ids: Mapping[str, int], scores: Mapping[str, float]
                       ) -> list[tuple[str, str]]:
    """SentencePiece BPE as merges: each way to cut a token into two vocabulary tokens,
    best score first; ties by the pieces' lengths (longer left first), then by their ids."""
    found = []
    for token, score in scores.items():
        cuts = [(token[:i], token[i:]) for i in range(1, len(token))
                if token[:i] in ids and token[i:] in ids]
        cuts.sort(key=lambda lr: (ids[lr[0]], ids[lr[1]]))
        found.extend((left, right, score) for left, right in cuts)
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _add_special_tokens(backend: tokenizers.Tokenizer, vocab: GGUFVocab) -> None:
    alphabet = set(byte_alphabet().values()) if vocab.model == "gpt2" else None
    control, user = [], []
    for token, kind in zip(vocab.tokens, vocab.token_types, strict=True):
        if kind == TokenType.CONTROL and (alphabet is None or set(token) <= alphabet):
            # A control token outside the byte alphabet is a llama.cpp mislabel; adding it
            # would grow the vocabulary past the model's (transformers skips it too).
            control.append(AddedToken(token, normalized=False, special=True))
        elif kind == TokenType.USER_DEFINED and backend.token_to_id(token) is not None:
            user.append(AddedToken(token, normalized=False, special=False))
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> character table: printable Latin-1 bytes stand for themselves, the
    others are shifted past U+0100 so that no byte is whitespace or a control character."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    shifted = (b for b in range(256) if b not in table)
    table.update({b: chr(256 + n) for n, b in enumerate(shifted)})
    return dict(sorted(table.items()))
