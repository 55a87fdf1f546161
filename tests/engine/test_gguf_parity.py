"""Greedy output from GGUF files equals HF transformers loading the same file (llama, qwen2,
and a Mistral written as llama.cpp writes it), and equals the engine on the HF checkpoint the
file was made from where transformers' GGUF loader does not cover the case (attention biases
on llama, rope_freqs, the mistral architecture with a sliding window)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from tests.helpers.checkpoints import save_tiny
from tests.helpers.gguf_files import gguf_from_hf, hf_gguf_model

pytest.importorskip("gguf")
pytest.importorskip("accelerate")

PROMPTS = [[1, 5, 9, 200, 33], [1, 400, 2, 3, 4, 5, 6, 7, 8, 17, 99], [1, 77]]
NEW = 8
# Every supported weight type once: the K-quants need rows of 256 (hidden 256 below).
MIXED = {"token_embd": "Q8_0", "attn_q": "Q4_K", "attn_k": "Q5_K", "attn_v": "Q6_K",
         "attn_output": "Q4_0", "ffn_gate": "Q4_1", "ffn_up": "BF16", "ffn_down": "F16",
         "output": "Q5_0"}
SMALL = {"token_embd": "Q8_0", "attn_q": "Q5_1", "attn_k": "F16", "attn_v": "Q4_1",
         "attn_output": "Q8_0", "ffn_gate": "Q4_0", "ffn_up": "Q8_0", "ffn_down": "F16"}


def by_part(table: dict[str, str]):
    def pick(name: str) -> str:
        part = name.split(".")[2] if name.startswith("blk.") else name.split(".")[0]
        return table.get(part, "F32")
    return pick


def hf_greedy(model, prompts, new=NEW) -> list[tuple[int, float]]:
    """(token, logprob) of each greedy token from transformers, prompt by prompt."""
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=new, min_new_tokens=new, eos_token_id=None,
                                 pad_token_id=0, output_logits=True,
                                 return_dict_in_generate=True)
            for token, logits in zip(gen.sequences[0, len(p):].tolist(), gen.logits,
                                     strict=True):
                out.append((token, torch.log_softmax(logits[0].float(), -1)[token].item()))
    return out


def engine_greedy(path, prompts, new=NEW, **options) -> list[tuple[int, float]]:
    """(token, logprob) of each greedy token from the engine: finer than the tokens alone
    (a tiny random model's greedy tokens barely depend on attention)."""
    with LLM(str(path), dtype="float32", **options) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=new, temperature=0,
                                                    ignore_eos=True, logprobs=0))
    return [(lp.token_id, lp.logprob) for o in outs for lp in o.logprobs]


def assert_same(ours, ref) -> None:
    assert [t for t, _ in ours] == [t for t, _ in ref]
    assert [lp for _, lp in ours] == pytest.approx([lp for _, lp in ref], abs=2e-4)


@pytest.mark.parametrize("family,arch,types,name,overrides", [
    ("llama", "llama", MIXED, "tiny",
     dict(hidden_size=256, intermediate_size=512)),
    ("qwen2", "qwen2", SMALL, "tiny", {}),
    # llama.cpp writes Mistral models as "llama"; transformers loads them as Mistral.
    ("mistral", "llama", SMALL, "tiny-mistral", dict(sliding_window=None)),
], ids=["llama-kquants", "qwen2", "mistral-as-llama"])
def test_greedy_equals_transformers_on_the_same_gguf(tmp_path, family, arch, types, name,
                                                     overrides):
    hf_dir = save_tiny(tmp_path / "hf", family, seed=7, **overrides)
    path = gguf_from_hf(hf_dir, tmp_path / f"{name}.gguf", arch, by_part(types), name=name)
    assert_same(engine_greedy(path, PROMPTS), hf_greedy(hf_gguf_model(path), PROMPTS))


def test_llama_attention_biases_load_as_in_the_hf_checkpoint(tmp_path, tiny_llama):
    # transformers' GGUF loader drops llama's attention biases; llama.cpp and we keep them.
    path = gguf_from_hf(tiny_llama, tmp_path / "bias.gguf", "llama")
    assert_same(engine_greedy(path, PROMPTS), engine_greedy(tiny_llama, PROMPTS))


def test_mistral_architecture_keeps_its_sliding_window(tmp_path, tiny_mistral):
    path = gguf_from_hf(tiny_mistral, tmp_path / "m.gguf", "mistral",
                        extra_hparams={"attention.sliding_window": 48})
    long = [[1] + [(i * 37) % 500 + 4 for i in range(70)]]  # past the window of 48
    assert_same(engine_greedy(path, long), engine_greedy(tiny_mistral, long))


def llama3_freq_factors(head_dim: int, theta: float, scaling: dict) -> np.ndarray:
    """llama.cpp's rope_freqs.weight for Llama 3.1 scaling (convert_hf_to_gguf.py)."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_rope_freqs_tensor_applies_llama3_scaling(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    hf_dir = save_tiny(tmp_path / "hf", "llama", seed=3, rope_scaling=scaling, head_dim=32)
    factors = llama3_freq_factors(32, 10000.0, scaling)
    path = gguf_from_hf(hf_dir, tmp_path / "l3.gguf", "llama",
                        extra_tensors=[("rope_freqs.weight", factors, "F32")])
    long = [[1] + [(i * 13) % 500 + 4 for i in range(90)]]  # past the original context
    ref = engine_greedy(hf_dir, long)
    assert_same(engine_greedy(path, long), ref)
    plain = engine_greedy(gguf_from_hf(hf_dir, tmp_path / "plain.gguf", "llama"), long)
    assert [lp for _, lp in plain] != pytest.approx([lp for _, lp in ref], abs=1e-3)


def test_tied_embeddings_and_tensor_parallel_from_gguf(tmp_path, tiny_qwen2):
    path = gguf_from_hf(tiny_qwen2, tmp_path / "q.gguf", "qwen2")
    assert_same(engine_greedy(path, PROMPTS[:1], tensor_parallel_size=2),
                engine_greedy(tiny_qwen2, PROMPTS[:1]))


def test_fp8_quantisation_is_chosen_by_config_for_gguf_too(tmp_path, tiny_qwen2):
    path = gguf_from_hf(tiny_qwen2, tmp_path / "q.gguf", "qwen2")
    assert_same(engine_greedy(path, PROMPTS[:1], quantization="fp8"),
                engine_greedy(tiny_qwen2, PROMPTS[:1], quantization="fp8"))


def test_model_path_can_be_a_directory_with_a_gguf(tmp_path, tiny_qwen2):
    d = tmp_path / "Qwen-Tiny"
    d.mkdir()
    gguf_from_hf(tiny_qwen2, d / "qwen.gguf", "qwen2")
    with LLM(str(d), dtype="float32") as llm:
        assert llm.engine.model_id == "Qwen-Tiny"
        out = llm.generate(["Hello world"], SamplingParams(max_tokens=4, temperature=0,
                                                           ignore_eos=True))
    with LLM(str(tiny_qwen2), dtype="float32") as ref:
        want = ref.generate(["Hello world"], SamplingParams(max_tokens=4, temperature=0,
                                                            ignore_eos=True))
    assert out[0].token_ids == want[0].token_ids and out[0].text == want[0].text


def test_a_gguf_draft_model_for_speculative_decoding(tmp_path, tiny_qwen2):
    draft = gguf_from_hf(tiny_qwen2, tmp_path / "draft.gguf", "qwen2")
    spec = {"model": str(draft), "num_speculative_tokens": 3}
    assert_same(engine_greedy(tiny_qwen2, PROMPTS[:2], speculative_config=spec),
                engine_greedy(tiny_qwen2, PROMPTS[:2]))
