"""A request continued on another engine with the output it already produced (migration)
ends exactly as an undisturbed run: the continuation samples token n with the seed's draw
for index n, and penalties, min_tokens, max_tokens and stop rules count the earlier tokens
as output."""

from __future__ import annotations

import pytest

from pdserve.engine import LLM, FinishReason, SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from tests.helpers.checkpoints import VOCAB
from tests.helpers.engine import random_prompts

CASES = {
    "greedy": SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7,
                             repetition_penalty=1.3, frequency_penalty=0.4, min_tokens=8),
}


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32", num_gpu_blocks=64)


def run(engine: LLMEngine, rid, prompt, params, generated=()):
    engine.add_request(rid, prompt, params, generated=generated)
    tokens, reason = [], None
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            reason = out.finish_reason or reason
    return tokens, reason


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("cut", [1, 5])
def test_a_continuation_on_another_engine_matches_the_undisturbed_run(tiny_llama, reference,
                                                                       name, cut):
    params = CASES[name]
    prompt = random_prompts([37], VOCAB, seed=40 + cut)[0]
    whole = reference.generate([prompt], params)[0]
    other = LLMEngine(EngineConfig(model=str(tiny_llama), dtype="float32", num_gpu_blocks=64))
    rest, reason = run(other, "m", prompt, params, generated=whole.token_ids[:cut])
    assert whole.token_ids[:cut] + rest == whole.token_ids
    assert reason == whole.finish_reason and other.pool.is_idle()


def test_output_that_already_ended_the_request_is_not_continued(reference):
    engine = reference.engine
    params = SamplingParams(max_tokens=4, stop_token_ids=(9,))
    assert engine.continuation_finished(10, params, [1, 2, 3, 4]) is FinishReason.LENGTH
    assert engine.continuation_finished(10, params, [1, 9]) is FinishReason.STOP
    assert engine.continuation_finished(10, params, [9, 1]) is None
    late = SamplingParams(max_tokens=4, stop_token_ids=(9,), min_tokens=3)
    assert engine.continuation_finished(10, late, [1, 9]) is None  # min_tokens not reached
