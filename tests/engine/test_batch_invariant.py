"""`batch_invariant=True`: a request's numbers do not depend on what else runs with it.

On a small Q4_1 GGUF (every linear layer 4-bit, as the default model's), seeded sampled and
greedy requests run all at once, with prompts chunked at a small token budget, and then one at
a time: every token and every logprob is the same bits. The default mode, run the same way,
gives some other bits (its int4 kernels round by batch size), so the comparison is one that
can fail. Configurations the mode cannot serve are refused before or at load."""

from __future__ import annotations

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import EngineConfig
from tests.helpers.checkpoints import VOCAB, save_tiny
from tests.helpers.engine import random_prompts
from tests.helpers.gguf_files import gguf_from_hf, q4_1_linears

LENGTHS = [5, 90, 17, 140, 33, 64, 9, 120, 48, 75]


@pytest.fixture(scope="module")
def q4_gguf(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("invariant")
    hf = save_tiny(tmp / "hf", "llama", seed=11, hidden_size=128, intermediate_size=256,
                   num_attention_heads=4, num_key_value_heads=2)

    return gguf_from_hf(hf, tmp / "q4.gguf", "llama", q4_1_linears)


def _params() -> list[SamplingParams]:
    # Every other request seeded sampling, the rest greedy; each token's logprob returned.
    return [SamplingParams(max_tokens=20, ignore_eos=True, logprobs=0,
                           temperature=0.0 if i % 2 == 0 else 1.0,
                           seed=None if i % 2 == 0 else 100 + i)
            for i in range(len(LENGTHS))]


def _together_and_alone(llm: LLM) -> tuple[list, list]:
    prompts, params = random_prompts(LENGTHS, VOCAB, seed=12), _params()
    together = llm.generate(prompts, params)
    alone = [llm.generate([p], [s])[0] for p, s in zip(prompts, params, strict=True)]

    def numbers(outs):
        return [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outs]
    return numbers(together), numbers(alone)


def test_tokens_and_logprobs_do_not_depend_on_the_batch(q4_gguf):
    # A budget of 64 tokens chunks the longer prompts differently together and alone.
    llm = LLM(str(q4_gguf), dtype="float32", batch_invariant=True,
              max_num_batched_tokens=64, enable_prefix_caching=False)
    together, alone = _together_and_alone(llm)
    assert together == alone


def test_the_default_mode_differs_so_the_check_can_fail(q4_gguf):
    llm = LLM(str(q4_gguf), dtype="float32", max_num_batched_tokens=64,
              enable_prefix_caching=False)
    together, alone = _together_and_alone(llm)
    assert together != alone


def test_greedy_tokens_are_the_default_modes(q4_gguf):
    prompts = random_prompts([12, 70], VOCAB, seed=13)
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    got = LLM(str(q4_gguf), dtype="float32", batch_invariant=True).generate(prompts, greedy)
    want = LLM(str(q4_gguf), dtype="float32").generate(prompts, greedy)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_what_it_cannot_serve_is_refused_with_the_reason(q4_gguf, tmp_path):
    for clash, value in (("tensor_parallel_size", 2), ("int4_kernel", "cpu"),
                         ("kv_cache_dtype", "fp8"), ("compile_decode", "inductor")):
        with pytest.raises(ValueError, match=clash):
            EngineConfig(model=str(q4_gguf), batch_invariant=True, **{clash: value})
    dense = save_tiny(tmp_path / "dense", "llama", seed=3)
    with pytest.raises(ValueError, match=r"batch_invariant.*layers\.0\..*rounding depends"):
        LLM(str(dense), dtype="float32", batch_invariant=True)
