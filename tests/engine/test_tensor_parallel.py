"""Tensor parallelism in the offline engine: TP=2 (two real processes over gloo) equals TP=1."""

from __future__ import annotations

import signal
import time

import pytest

from pdserve.engine import LLM, SamplingParams
from tests.helpers.checkpoints import VOCAB, save_tiny
from tests.helpers.engine import assert_idle, random_prompts

pytestmark = pytest.mark.timeout(300)
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def lively_llama(tmp_path_factory):
    # A larger init spread so greedy outputs vary (the default gives near-uniform logits).
    return save_tiny(tmp_path_factory.mktemp("lively"), "llama", seed=7, initializer_range=0.2,
                     attention_bias=True)


@pytest.mark.parametrize("ckpt", ["lively_llama", "tiny_qwen2", "tiny_llama3"])
def test_tp2_equals_tp1(request, ckpt):
    path = str(request.getfixturevalue(ckpt))  # tiny_llama3 has 1 KV head: replicated
    prompts = random_prompts([4, 23, 61], VOCAB, seed=31)
    ref = LLM(path, dtype="float32")
    expected = [o.token_ids for o in ref.generate(prompts, GREEDY)]
    ref_logits = ref.engine.prompt_logits(prompts[2])
    with LLM(path, dtype="float32", tensor_parallel_size=2, max_num_batched_tokens=24) as llm:
        got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        logits = llm.engine.prompt_logits(prompts[2])
        assert_idle(llm)
    assert got == expected
    assert (logits - ref_logits).abs().max().item() < 1e-4


def test_heads_that_do_not_split_are_refused(tmp_path):
    path = save_tiny(tmp_path / "odd", "llama", num_attention_heads=3, num_key_value_heads=3,
                     hidden_size=48)
    with pytest.raises(ValueError, match="heads"):
        LLM(str(path), dtype="float32", tensor_parallel_size=2)


def test_a_dead_rank_fails_the_engine_instead_of_hanging(lively_llama):
    llm = LLM(str(lively_llama), dtype="float32", tensor_parallel_size=2)
    try:
        follower = llm.engine.tp_driver.followers[0]
        follower.send_signal(signal.SIGKILL)
        follower.wait(timeout=30)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError):
            llm.generate(random_prompts([8], VOCAB), GREEDY)
        assert time.monotonic() - t0 < 30
    finally:
        llm.close()
