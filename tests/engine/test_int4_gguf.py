"""W4A16 from GGUF: Q4_0 / Q4_1 / Q4_K blocks reach the kernels as `Int4Weight`s, repacked
without being dequantised, on small files the tests write and on the real default model."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.checkpoint.gguf_names import is_linear as is_linear_gguf
from pdserve.engine.layers.linear import LinearBase
from pdserve.engine.quant.int4_weight import Int4Weight
from tests.helpers.checkpoints import VOCAB, save_tiny
from tests.helpers.engine import random_prompts
from tests.helpers.gguf_files import gguf_from_hf
from tests.helpers.real_model import CHAT_TOKENS, NEW_TOKENS, QUESTION

# Every 4-bit type, a 4-bit part fused with a dense one (gate Q4_1 + up F32, quantised at
# load in groups of 128 and split to the Q4_1 groups of 32), and a Q8_0 layer (dense).
TYPES = {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q4_K", "attn_output": "Q4_K",
         "ffn_gate": "Q4_1", "ffn_up": "F32", "ffn_down": "Q8_0"}


def _type(name: str) -> str:
    return next((t for part, t in TYPES.items() if f".{part}." in name), "F32")


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("int4_gguf")
    # 256 features: Q4_K's super-blocks hold 256 values per row.
    hf = save_tiny(tmp / "hf", "llama", seed=6, hidden_size=256, intermediate_size=512,
                   num_attention_heads=4, num_key_value_heads=2)
    return gguf_from_hf(hf, tmp / "mixed.gguf", "llama", _type)


def test_4bit_blocks_are_repacked_without_dequantising(mixed_gguf, monkeypatch):
    dense = LLM(str(mixed_gguf), num_gpu_blocks=16)  # the gguf package's dequantisation

    def refuse(self, dtype=torch.float32):
        raise AssertionError("a 4-bit GGUF weight was dequantised on its way to the kernel")

    monkeypatch.setattr(Int4Weight, "dequantize", refuse)
    int4 = LLM(str(mixed_gguf), num_gpu_blocks=16, quantization="int4")
    monkeypatch.undo()
    want = dict(dense.engine.runner.model.named_modules())
    for name, layer in int4.engine.runner.model.named_modules():
        if not isinstance(layer, LinearBase):
            continue
        w = want[name].weight
        got = layer.method.dequantize()
        # bf16 scale and zero in the CPU kernel (see test_int4_linear.py); the F32 up half
        # and the Q8_0 down projection were quantised at load: a 4-bit step, not rounding.
        exact = "down_proj" not in name and "gate_up" not in name
        bound = 2**-8 * 2.1 * w.abs().max() if exact else w.abs().max() / 15
        assert (got - w).abs().max() <= bound, name
        if "gate_up" in name:
            gate = got[:512]
            assert (gate - w[:512]).abs().max() <= 2**-8 * 2.1 * w[:512].abs().max()
    for prompt in random_prompts([7, 40], VOCAB, seed=8):
        a, b = int4.engine.prompt_logits(prompt), dense.engine.prompt_logits(prompt)
        assert ((a - b).norm() / b.norm()).item() < 0.1


def test_a_gguf_of_4bit_blocks_runs_as_int4_unless_asked_for_dense(mixed_gguf, tmp_path):
    """A file whose every linear weight is a 4-bit block format is a 4-bit checkpoint: it runs
    as stored (as llama.cpp and vLLM serve it); quantization="none" dequantises it. A file
    mixing in other types runs dense, instead of re-quantising its 8-bit and float layers."""
    hf = save_tiny(tmp_path / "hf", "llama", seed=2, hidden_size=64, intermediate_size=128,
                   num_attention_heads=4, num_key_value_heads=2)
    # Q4_1 layers and a Q8_0 embedding, as llama.cpp writes a Q4_1 file
    q4 = gguf_from_hf(hf, tmp_path / "q4.gguf", "llama",
                      lambda name: "Q4_1" if is_linear_gguf(name) else
                      "Q8_0" if name in ("token_embd.weight", "output.weight") else "F32")

    def methods(llm):
        return {type(m.method).__name__ for m in llm.engine.runner.model.modules()
                if isinstance(m, LinearBase)}

    native = LLM(str(q4), num_gpu_blocks=16)
    assert methods(native) == {"Int4LinearMethod"}
    assert native.engine.runner.model.lm_head.method.__class__.__name__ == "Int8HeadMethod"
    dense = LLM(str(q4), num_gpu_blocks=16, quantization="none")
    assert methods(dense) == {"LinearMethod"}
    prompt = random_prompts([12], VOCAB, seed=4)[0]
    a, b = native.engine.prompt_logits(prompt), dense.engine.prompt_logits(prompt)
    assert ((a - b).norm() / b.norm()).item() < 1e-4  # the same weights, fp32 arithmetic
    assert methods(LLM(str(mixed_gguf), num_gpu_blocks=16)) == {"LinearMethod"}


@pytest.mark.timeout(900)  # the session's real-model references may be computed here first
def test_real_model_runs_its_q4_1_blocks_and_agrees_with_the_dense_engine(
        default_model, default_model_engine_ref):
    """The default engine multiplies by the file's Q4_1 blocks (pdserve's fp32-activation
    kernel) and its Q8_0 embedding as the int8 head: the dense engine's weights exactly, so
    only summation order separates them (measured 100% top-1 over bench/real_text.py's 1,524
    positions)."""
    ref = default_model_engine_ref  # the default engine: int4 as stored
    with LLM(str(default_model), dtype="float32") as llm:
        kernels = {m.method.kernel.group_size for m in llm.engine.runner.model.modules()
                   if isinstance(m, LinearBase)}
        assert kernels == {32}  # Q4_1's blocks, not regrouped
    with LLM(str(default_model), dtype="float32", quantization="none") as llm:
        same = total = 0
        for ids, cont in zip(ref["prompt_ids"], ref["greedy"], strict=True):
            top1 = llm.engine.prompt_logits(ids + cont[:-1])[len(ids) - 1:].argmax(-1)
            same += (top1 == torch.tensor(cont)).sum().item()
            total += NEW_TOKENS
        chat = SamplingParams(max_tokens=CHAT_TOKENS, temperature=0.0)
        answer = llm.generate([llm.tokenizer.encode_chat(QUESTION)], chat)[0].text
    assert same / total >= 0.97, same / total
    assert "Paris" in answer
