"""W4A16 inside the engine: speculative decoding, FP8 KV cache, the block hash, TP=2 == TP=1."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from tests.helpers.checkpoints import VOCAB, make_bigram, save_tiny
from tests.helpers.engine import (
    assert_idle,
    check_fp8_kv_on_top,
    greedy_ids,
    random_prompts,
)

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def int4_tiny(tiny_llama):
    return LLM(str(tiny_llama), num_gpu_blocks=64, quantization="int4")


def test_greedy_ngram_speculation_equals_speculation_off(tiny_llama, int4_tiny, one_thread):
    # Prompts that repeat themselves, so prompt lookup has drafts to offer.
    base = random_prompts([6, 9, 5], VOCAB, seed=4)
    prompts = [p * 4 for p in base] + random_prompts([30], VOCAB, seed=5)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in int4_tiny.generate(prompts, params)]
    spec = LLM(str(tiny_llama), num_gpu_blocks=64, quantization="int4",
               max_num_batched_tokens=16, speculative_config={
                   "method": "ngram", "num_speculative_tokens": 3, "adaptive": False})
    assert [o.token_ids for o in spec.generate(prompts, params)] == want
    stats = spec.engine.stats()
    assert stats["spec_drafts_proposed"] > 0 and stats["spec_drafts_accepted"] > 0
    assert_idle(spec)


def test_int4_weights_with_an_fp8_kv_cache(tiny_llama, int4_tiny):
    both = LLM(str(tiny_llama), num_gpu_blocks=64, quantization="int4", kv_cache_dtype="fp8")
    check_fp8_kv_on_top(both, int4_tiny, VOCAB, GREEDY.max_tokens)


def test_the_block_hash_names_the_weight_scheme(tiny_llama, int4_tiny):
    extras = {q: LLM(str(tiny_llama), num_gpu_blocks=8, quantization=q).engine.scheduler.kv
              .hash_extra for q in (None, "fp8")}
    extras["int4"] = int4_tiny.engine.scheduler.kv.hash_extra
    assert len(set(extras.values())) == 3


@pytest.fixture(scope="module")
def bigram_dir(tmp_path_factory):
    # Decisive logits (see make_bigram), so bf16 rounding differences between the TP=1 sum
    # and the TP=2 partial sums cannot flip a greedy token.
    d = save_tiny(tmp_path_factory.mktemp("int4_tp"), "llama", seed=5, hidden_size=256,
                  intermediate_size=VOCAB, num_attention_heads=8, num_key_value_heads=4)
    make_bigram(d)
    return d


@pytest.mark.timeout(300)
def test_tp2_equals_tp1(bigram_dir):
    prompts = random_prompts([4, 23, 61], VOCAB, seed=31)
    ref = LLM(str(bigram_dir), num_gpu_blocks=64, quantization="int4")
    want = greedy_ids(ref, prompts, 12)
    ref_logits = ref.engine.prompt_logits(prompts[2])
    with LLM(str(bigram_dir), num_gpu_blocks=64, quantization="int4", tensor_parallel_size=2,
             max_num_batched_tokens=24) as llm:
        assert greedy_ids(llm, prompts, 12) == want
        logits = llm.engine.prompt_logits(prompts[2])
        assert_idle(llm)
    # Each rank's row-parallel partial sum leaves the kernel in bf16 (2^-8 relative).
    err = (logits - ref_logits).abs().max() / ref_logits.abs().max()
    assert err < 0.01, err
