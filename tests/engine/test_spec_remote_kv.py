"""Draft-model speculation for a request whose prompt KV was computed by another engine.

This is a decode worker's situation: a prefill worker computes the prompt KV and the first
token, the KV lands in the decode engine's reserved blocks, and the request is activated
through the engine's remote-KV API (`reserve_remote` / `activate_remote`), as the decode
worker does. The draft model never saw the prompt; it must catch up on its own cache before
drafting (see `pdserve/engine/spec/draft_model.py`).
With the target as its own draft, acceptance stays near 1 only if that catch-up is right.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from tests.helpers.checkpoints import VOCAB
from tests.helpers.engine import random_prompts

PROMPT_LEN = 45
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def prefill_elsewhere(model, prompt) -> tuple[LLMEngine, list[int], int]:
    """A separate engine prefills the prompt: its engine, the prompt's blocks, first token."""
    pre = LLMEngine(EngineConfig(model=str(model), dtype="float32", num_gpu_blocks=32))
    req = pre.add_request("r", prompt, PARAMS, seed=0)
    (out,) = pre.step()
    assert len(out.new_token_ids) == 1 and req.num_computed_tokens == len(prompt)
    return pre, list(req.block_ids), out.new_token_ids[0]


def receive_and_activate(dec: LLMEngine, prompt, src: LLMEngine, src_blocks, first: int):
    """Reserve blocks, land every layer's KV in the blocks still needed (what the transfer
    engine does), activate."""
    res = dec.reserve_remote("r", prompt, PARAMS, seed=0)
    need = torch.tensor(res.needed)
    for s, d in zip(src.runner.caches, dec.runner.caches, strict=True):
        d[need] = s[torch.tensor(src_blocks[res.cached_blocks:len(res.block_ids)])]
    assert dec.activate_remote("r", first) is None  # it runs on


def assert_draft_kv_matches_target(dec: LLMEngine, drafter) -> int:
    """The target is its own draft here, so wherever the draft claims right KV it must equal
    the target's KV at the same positions. Returns how many positions were compared."""
    state = drafter.kv_state("r")
    assert state is not None, "the draft holds no KV for a request it drafts for"
    draft_blocks, draft_computed = state
    req = dec.scheduler.requests["r"]
    n = min(draft_computed, req.num_computed_tokens)
    bs = dec.config.block_size
    pos = torch.arange(n)
    for d, t in zip(drafter.runner.caches, dec.runner.caches, strict=True):
        dk = d[torch.tensor(draft_blocks)[pos // bs], :, :, pos % bs]
        tk = t[torch.tensor(req.block_ids)[pos // bs], :, :, pos % bs]
        torch.testing.assert_close(dk, tk, rtol=1e-4, atol=1e-5)
    return n


@pytest.mark.parametrize("step_tokens", [1024, 16])  # 16: the catch-up spans several steps
def test_draft_catches_up_on_remotely_prefilled_request(tiny_llama, step_tokens):
    prompt = random_prompts([PROMPT_LEN], VOCAB, seed=31)[0]
    reference = LLM(str(tiny_llama), dtype="float32", num_gpu_blocks=32).generate(
        [prompt], PARAMS)[0].token_ids
    pre, src_blocks, first = prefill_elsewhere(tiny_llama, prompt)
    dec = LLMEngine(EngineConfig(
        model=str(tiny_llama), dtype="float32", num_gpu_blocks=32,
        max_num_batched_tokens=step_tokens,
        speculative_config={"model": str(tiny_llama), "num_speculative_tokens": 3,
                            "adaptive": False}))
    drafter = dec.spec.proposer
    receive_and_activate(dec, prompt, pre, src_blocks, first)
    pre.abort("r")
    assert drafter.pool.num_used == 0  # the draft has seen nothing of this request yet

    tokens = [first]
    checked = 0  # most positions compared in one step
    while dec.has_unfinished():
        for out in dec.step():
            tokens.extend(out.new_token_ids)
        if dec.has_unfinished():
            checked = max(checked, assert_draft_kv_matches_target(dec, drafter))
    assert checked > PROMPT_LEN  # the whole caught-up prompt and accepted drafts
    assert tokens == reference
    stats = dec.stats()
    assert stats["spec_drafts_proposed"] > 0
    assert stats["spec_acceptance_rate"] > 0.9  # only if the caught-up draft KV is right
    assert dec.pool.is_idle() and drafter.is_idle() and not dec.has_unfinished()
    assert pre.pool.is_idle()
