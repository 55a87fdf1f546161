"""Choices forked from one request (`n` > 1): the prompt is computed once, each choice shares
its full blocks and gets a copy of the last partial block, computes only the last prompt
token and samples with its own seed. Outputs equal those of separate requests with the same
seeds; blocks return to idle however the choices end."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.sampler import choice_seed
from tests.helpers.engine import assert_idle, random_prompts


def run(llm: LLM, prompt, params, n: int, seed: int) -> tuple[list[list[int]], int]:
    """(each choice's tokens, prompt tokens computed) for one request forked n ways."""
    engine = llm.engine
    computed = 0
    forward = engine.runner.forward

    def counting(chunks, *args, **kw):
        nonlocal computed
        computed += sum(len(c.token_ids) for c in chunks if c.num_samples <= 1
                        and c.start < len(prompt))
        return forward(chunks, *args, **kw)

    engine.runner.forward = counting
    try:
        ids = ["p"] + [f"p.c{j}" for j in range(1, n)]
        engine.add_request("p", prompt, params, seed,
                           forks=[(ids[j], choice_seed(seed, j)) for j in range(1, n)])
        out: dict[str, list[int]] = {i: [] for i in ids}
        while engine.has_unfinished():
            for o in engine.step():
                out[o.request_id].extend(o.new_token_ids)
    finally:
        engine.runner.forward = forward
    return [out[i] for i in ids], computed


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32", num_gpu_blocks=128)


@pytest.mark.parametrize("length", [33, 40, 48])  # partial last block, block boundary cases
def test_forked_choices_equal_separate_seeded_requests(llm, length):
    prompt = random_prompts([length], 512, seed=length)[0]
    params = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    choices, computed = run(llm, prompt, params, 4, seed=11)
    alone = [llm.generate([prompt], SamplingParams(max_tokens=8, temperature=1.0,
                                                   ignore_eos=True, seed=choice_seed(11, j)))
             [0].token_ids for j in range(4)]
    assert choices == alone
    assert len({tuple(c) for c in choices}) == 4
    assert computed == length + 3  # the prompt once, then one token per other choice
    assert_idle(llm)


def test_greedy_choices_are_the_parent_and_n1_is_unchanged(llm):
    prompt = random_prompts([21], 512, seed=3)[0]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    choices, _ = run(llm, prompt, params, 3, seed=5)
    ref = llm.generate([prompt], params)[0].token_ids
    assert choices == [ref] * 3
    fresh = random_prompts([21], 512, seed=30)[0]
    (only,), computed = run(llm, fresh, params, 1, seed=5)
    assert only == llm.generate([fresh], params)[0].token_ids and computed == 21
    assert_idle(llm)


def test_forks_under_preemption_and_without_prefix_caching(tiny_llama):
    prompt = random_prompts([37], 512, seed=9)[0]
    params = SamplingParams(max_tokens=20, temperature=0.8, ignore_eos=True)
    roomy = LLM(str(tiny_llama), dtype="float32", num_gpu_blocks=128)
    want, _ = run(roomy, prompt, params, 4, seed=2)
    for options in ({"num_gpu_blocks": 9}, {"enable_prefix_caching": False}):
        other = LLM(str(tiny_llama), dtype="float32", **{"num_gpu_blocks": 128, **options})
        got, _ = run(other, prompt, params, 4, seed=2)
        assert got == want, options
        assert_idle(other)


def test_a_parent_ended_by_its_first_token_still_forks(llm):
    prompt = random_prompts([19], 512, seed=4)[0]
    choices, _ = run(llm, prompt, SamplingParams(max_tokens=1, temperature=1.0), 3, seed=8)
    assert [len(c) for c in choices] == [1, 1, 1]
    assert_idle(llm)


def test_remote_kv_forks_after_activation(llm, tiny_llama):
    """A decode worker's request: the prefill worker's KV lands, then the choices fork."""
    engine = llm.engine
    prompt = random_prompts([30], 512, seed=12)[0]
    params = SamplingParams(max_tokens=5, temperature=1.0, ignore_eos=True)
    ref, _ = run(llm, prompt, params, 3, seed=21)
    res = engine.reserve_remote("r", prompt, params, 21,
                                forks=[("r.c1", choice_seed(21, 1)), ("r.c2", choice_seed(21, 2))])
    src = LLM(str(tiny_llama), dtype="float32", num_gpu_blocks=128)  # "the prefill worker"
    src.engine.add_request("s", prompt, params, 21)
    (first,) = next(o for o in src.engine.step() if o.new_token_ids).new_token_ids
    held = src.engine.scheduler.requests["s"].block_ids
    with torch.no_grad():  # what the transfer does: every layer's blocks, in prompt order
        for cache, sent in zip(engine.kv_caches, src.engine.kv_caches, strict=True):
            cache[list(res.block_ids)] = sent[held[:len(res.block_ids)]]
    src.engine.abort("s")
    assert engine.activate_remote("r", first) is None
    out: dict[str, list[int]] = {"r": [first], "r.c1": [], "r.c2": []}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    assert [out["r"], out["r.c1"], out["r.c2"]] == ref
    assert_idle(llm)


def test_forks_copy_the_partial_block_on_every_tensor_parallel_rank(llm, tiny_llama):
    prompt = random_prompts([27], 512, seed=14)[0]
    params = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)
    want, _ = run(llm, prompt, params, 3, seed=6)
    with LLM(str(tiny_llama), dtype="float32", num_gpu_blocks=64,
             tensor_parallel_size=2) as two:
        got, _ = run(two, prompt, params, 3, seed=6)
        assert_idle(two)
    assert got == want
