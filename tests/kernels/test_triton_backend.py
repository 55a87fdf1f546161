"""TritonAttention behind the backend registry, then the tiny model end to end.

The engine tests compare greedy tokens and their log-probabilities of `LLM(...,
attention_backend="triton")` with the torch reference backend on the same checkpoint. Small KV
blocks and a small token budget make the prompts span several blocks and arrive as chunked
prefill with a cached prefix next to decode rows, so every kernel path runs; one case stores
the KV cache as packed FP8.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.attention.backend import get_backend
from tests.helpers.checkpoints import VOCAB, save_tiny
from tests.helpers.engine import random_prompts
from tests.kernels.cases import make_case


@pytest.mark.parametrize("q_lens,ctx_lens", [([1, 1, 1], [5, 12, 3]), ([1, 6, 2], [9, 6, 14])])
def test_backend_writes_then_attends_like_the_reference(device, q_lens, ctx_lens):
    case = make_case(q_lens, ctx_lens, seed=len(ctx_lens) + sum(q_lens), device=device)
    results = []
    for name in ("triton", "torch"):
        backend, cache = get_backend(name), case.cache.clone()
        backend.write_kv(cache, case.k, case.v, case.meta)
        results.append((cache, backend.attend(case.q, cache, case.meta, case.scale, None)))
    (cache_t, out_t), (cache_r, out_r) = results
    assert torch.equal(cache_t, cache_r)
    torch.testing.assert_close(out_t, out_r, atol=2e-5, rtol=0)


def _greedy(model_dir, backend: str, prompts: list[list[int]], device, **options) -> list:
    llm = LLM(str(model_dir), dtype="float32", device=str(device), attention_backend=backend,
              block_size=4, max_num_batched_tokens=8, num_gpu_blocks=64, **options)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=1)
    return llm.generate(prompts, params)


@pytest.mark.parametrize("family,overrides,options", [
    ("llama", {}, {}),
    ("mistral", {"sliding_window": 5}, {}),
    ("llama", {}, {"kv_cache_dtype": "fp8"}),
], ids=["llama", "mistral-window", "llama-fp8-kv"])
def test_tiny_model_greedy_parity_with_torch_backend(tmp_path, device, family, overrides,
                                                     options):
    torch.set_num_threads(1)
    model_dir = save_tiny(tmp_path / family, family, seed=11, **overrides)
    prompts = random_prompts([10, 7], VOCAB, seed=12)
    ours = _greedy(model_dir, "triton", prompts, device, **options)
    ref = _greedy(model_dir, "torch", prompts, device, **options)
    for a, b in zip(ours, ref, strict=True):
        assert a.token_ids == b.token_ids
        lp_a = torch.tensor([lp.logprob for lp in a.logprobs])
        lp_b = torch.tensor([lp.logprob for lp in b.logprobs])
        torch.testing.assert_close(lp_a, lp_b, atol=1e-4, rtol=0)
