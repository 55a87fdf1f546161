"""Engine behaviour: seeded sampling independent of the batch, stop rules, validation."""

from __future__ import annotations

import pytest

from pdserve.engine import LLM, SamplingParams
from tests.helpers.checkpoints import VOCAB
from tests.helpers.engine import assert_idle, random_prompts


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32", max_num_batched_tokens=32)


def test_seeded_sampling_is_identical_alone_and_in_a_mixed_batch(llm):
    target = random_prompts([21], VOCAB, seed=7)[0]
    p = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=1234,
                       ignore_eos=True)
    alone = llm.generate([target], p)[0].token_ids
    others = random_prompts([5, 33, 60], VOCAB, seed=8)
    mixed = llm.generate(
        others[:2] + [target] + others[2:],
        [SamplingParams(max_tokens=9, temperature=1.0, seed=5, ignore_eos=True),
         SamplingParams(max_tokens=3, temperature=0.0),
         p,
         SamplingParams(max_tokens=15, temperature=0.7, ignore_eos=True)])
    assert mixed[2].token_ids == alone
    assert_idle(llm)


def test_max_tokens_and_stop_token_ids(llm):
    prompt = random_prompts([10], VOCAB, seed=9)[0]
    free = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert len(free[0].token_ids) == 8 and free[0].finish_reason == "length"
    stop_at = free[0].token_ids[3]
    cut = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                stop_token_ids=[stop_at]))
    first = free[0].token_ids.index(stop_at)
    assert cut[0].token_ids == free[0].token_ids[: first + 1]
    assert cut[0].finish_reason == "stop"
    assert_idle(llm)


def test_stop_string_truncates_text(llm):
    prompt = random_prompts([10], VOCAB, seed=10)[0]
    full = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    text = full[0].text
    assert len(text) > 4
    stop = text[2:4]
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.find(stop)]
    assert_idle(llm)


def test_logprobs_of_chosen_and_top_tokens(llm):
    prompt = random_prompts([10], VOCAB, seed=11)[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, logprobs=3,
                                                ignore_eos=True))[0]
    assert out.logprobs is not None and len(out.logprobs) == 4
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == tok and len(lp.top) == 3
        assert lp.top[0][0] == tok  # greedy picks the most likely token
        assert lp.logprob == pytest.approx(lp.top[0][1])


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ([], SamplingParams(), "prompt"),
        ([5] * 2000, SamplingParams(), "prompt"),
        ([5, VOCAB + 3], SamplingParams(), "prompt_token_ids"),
        ([5, -1], SamplingParams(), "prompt_token_ids"),
    ],
)
def test_bad_input_raises_value_error_naming_the_field(llm, prompt, params, field):
    with pytest.raises(ValueError, match=field):
        llm.generate([prompt], params)
    assert_idle(llm)


@pytest.mark.parametrize("kwargs, field", [({"max_tokens": -1}, "max_tokens"),
                                           ({"top_p": 1.5}, "top_p"),
                                           ({"top_p": 0.0}, "top_p")])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_text_prompts_and_empty_string(llm):
    out = llm.generate("hello world", SamplingParams(max_tokens=3, temperature=0))
    assert len(out) == 1 and out[0].prompt_token_ids[0] == llm.tokenizer.bos_token_id
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([""], SamplingParams())
    assert_idle(llm)
