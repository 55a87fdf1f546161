"""Small GGUF files written with `gguf.GGUFWriter`, the way llama.cpp's converter writes them.

`gguf_from_hf` turns a tiny random HF checkpoint (tests/helpers/checkpoints.py) into a GGUF of
the given architecture: llama.cpp's metadata keys, its tensor names, its q/k row interleave for
the llama architecture (written here from llama.cpp's formula, independently of the loader's
inverse), each tensor in the type `types(name)` picks, and the demo byte-level BPE vocabulary.
Types the `gguf` package cannot quantise (the K-quants) get random blocks with finite, small
scales: the file is then its own reference (transformers and the engine both read it).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

CONTROL, NORMAL, BYTE = 3, 1, 6
_HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
           "output_norm.weight", "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_HF_TO_GGUF[module]}.{kind}"


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute: rotary halves -> interleaved."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def encode(values: np.ndarray, type_name: str, rng: np.random.Generator) -> np.ndarray:
    """`values` (float32, rows x cols) stored as `type_name`: the array GGUFWriter takes."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"):
        return random_blocks(values.shape, type_name, rng)
    return gguf.quants.quantize(values.astype(np.float32), qtype)


def random_blocks(shape: tuple[int, ...], type_name: str, rng: np.random.Generator,
                  scale: float = 2e-4) -> np.ndarray:
    """Random blocks of a K-quant whose f16 scales are small and finite."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    values, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    blocks = rng.integers(0, 256, size=(rows, cols // values, nbytes), dtype=np.uint8)
    # Each layout keeps its f16 super-scales at fixed offsets: d (and dmin) first, except Q6_K
    # and Q3_K whose d is the last two bytes.
    offsets = {"Q2_K": [nbytes - 4, nbytes - 2], "Q3_K": [nbytes - 2], "Q4_K": [0, 2],
               "Q5_K": [0, 2], "Q6_K": [nbytes - 2]}[type_name]
    for off in offsets:
        d = (np.abs(rng.standard_normal((rows, cols // values))) * scale + scale / 4)
        blocks[..., off:off + 2] = d.astype(np.float16)[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def byte_level_vocab(tokenizer_dir: Path) -> dict:
    """tokens / merges / token types of a tokenizer.json's byte-level BPE, as GGUF lists them."""
    data = json.loads((Path(tokenizer_dir) / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    tokens = [None] * len(vocab)
    for token, i in vocab.items():
        tokens[i] = token
    special = {t["content"] for t in data["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return {"model": "gpt2", "tokens": tokens, "merges": merges,
            "types": [CONTROL if t in special else NORMAL for t in tokens]}


def write_gguf(path: Path, arch: str, hparams: dict, tensors: list[tuple[str, np.ndarray, str]],
               vocab: dict, *, name: str = "tiny", pre: str = "gpt2",
               special: dict | None = None, chat_template: str | None = None,
               extra: Callable | None = None) -> Path:
    """A GGUF with llama.cpp's `<arch>.*` keys from `hparams`, these tensors (name, array as
    `encode` returns it, type name), this vocabulary and `special` `tokenizer.ggml.*` keys
    (`bos_token_id`, `add_bos_token`, ...; default: the demo tokenizer's ids)."""
    import gguf

    w = gguf.GGUFWriter(path, arch)
    w.add_name(name)
    for key, value in hparams.items():
        if isinstance(value, float):
            w.add_float32(f"{arch}.{key}", value)
        else:
            w.add_uint32(f"{arch}.{key}", value)
    w.add_tokenizer_model(vocab["model"])
    if vocab["model"] == "gpt2":
        w.add_tokenizer_pre(pre)
        w.add_token_merges(vocab["merges"])
    else:
        w.add_token_scores(vocab["scores"])
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["types"])
    specials = {"bos_token_id": 1, "eos_token_id": 2, "unknown_token_id": 0,
                "padding_token_id": 3} if special is None else special
    for key, value in specials.items():
        if isinstance(value, bool):
            w.add_bool(f"tokenizer.ggml.{key}", value)
        else:
            w.add_uint32(f"tokenizer.ggml.{key}", value)
    if chat_template:
        w.add_chat_template(chat_template)
    if extra is not None:
        extra(w)
    for tname, data, type_name in tensors:
        w.add_tensor(tname, data, raw_dtype=gguf.GGMLQuantizationType[type_name])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


_LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def q4_1_linears(name: str) -> str:
    """A `types` for gguf_from_hf: every linear layer Q4_1, the rest F32 (as the default
    model's file)."""
    return "Q4_1" if any(f".{p}." in name for p in _LINEARS) else "F32"


def gguf_from_hf(hf_dir: Path, out: Path, arch: str = "llama",
                 types: Callable[[str], str] = lambda name: "F32", seed: int = 0,
                 name: str = "tiny", pre: str = "gpt2", extra_hparams: dict | None = None,
                 extra_tensors: list[tuple[str, np.ndarray, str]] | None = None) -> Path:
    """The HF checkpoint at `hf_dir` as a GGUF file `out` of architecture `arch`."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    hparams = {
        "context_length": cfg["max_position_embeddings"], "embedding_length": cfg["hidden_size"],
        "block_count": cfg["num_hidden_layers"], "feed_forward_length": cfg["intermediate_size"],
        "attention.head_count": heads, "attention.head_count_kv": kv_heads,
        "rope.dimension_count": head_dim, "attention.key_length": head_dim,
        "attention.value_length": head_dim,
        "rope.freq_base": float(cfg.get("rope_theta") or
                                (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        "attention.layer_norm_rms_epsilon": float(cfg["rms_norm_eps"]),
        "vocab_size": cfg["vocab_size"], **(extra_hparams or {}),
    }
    rng = np.random.default_rng(seed)
    tensors = list(extra_tensors or [])
    for hf, value in load_file(str(hf_dir / "model.safetensors")).items():
        g = gguf_name(hf)
        value = value.astype(np.float32)
        if arch in ("llama", "mistral") and (".attn_q." in g or ".attn_k." in g):
            value = llama_cpp_permute(value, heads if ".attn_q." in g else kv_heads)
        kind = types(g) if value.ndim == 2 else "F32"
        tensors.append((g, encode(value, kind, rng), kind))
    from pdserve.demo_model import CHAT_TEMPLATE

    return write_gguf(out, arch, hparams, tensors, byte_level_vocab(hf_dir), name=name,
                      pre=pre, chat_template=CHAT_TEMPLATE)


def hf_gguf_model(path: Path):
    """transformers' model loaded from the GGUF file (dequantised, float32)."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def hf_gguf_tokenizer(path: Path):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def sentencepiece_vocab(size: int = 600) -> dict:
    """A Llama-2-style vocabulary (`tokenizer.ggml.model = llama`): <unk> <s> </s>, the 256
    byte tokens <0x00>..<0xFF>, then pieces with "▁" for spaces, scored by merge order."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from pdserve.demo_model import _corpus_lines

    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=specials, show_progress=False)
    tok.train_from_iterator((line for i, line in enumerate(_corpus_lines()) if i < 3000),
                            trainer=trainer)
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    # SentencePiece scores: later merges score lower; single characters lowest of all.
    scores = [0.0 if t in specials else (-float(i) if len(t) > 1 else -1e6 - i)
              for i, t in enumerate(tokens)]
    types = [CONTROL if i < 3 else BYTE if i < len(specials) else NORMAL
             for i in range(len(tokens))]
    return {"model": "llama", "tokens": tokens, "scores": scores, "types": types}
