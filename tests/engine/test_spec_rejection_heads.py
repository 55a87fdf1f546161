"""A learned drafter keeps the target's distribution exactly: sampled requests under EAGLE
speculation (the fitted head, so drafts are both accepted and rejected) emit their second and
third tokens with the target's conditional distributions (Pearson chi-square, alpha = 1e-3).

Every request shares one prompt and has its own seed; top-k 4 at temperature 1 gives four
cells. The first token is an ordinary draw; the second is always decided by rejection
sampling against the head's q (the step after the prompt verifies two drafts); the third by
the same verification or the next. Power: conditionally on the most likely first token
(p ~ 0.35 here, n ~ 2800 of N = 8000) a 5% shift between two tokens of p ~ 0.3 has
noncentrality 2800 * 0.05^2 * (2 / 0.3) = 47 against a critical value of 16.3 (3 degrees of
freedom): detected with probability > 0.99; the third token, given the most likely pair
(n ~ 500), detects a 10% shift with probability ~ 0.9.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.sampler import Sampler, SamplingRow
from tests.engine.test_spec_rejection import (  # noqa: F401 - one_thread is a fixture
    ALPHA,
    chi2_pvalue,
    one_thread,
)
from tests.helpers.checkpoints import VOCAB
from tests.helpers.draft_heads import fit_prompts

N = 8000
TOP_K = 4

pytestmark = pytest.mark.timeout(600)


def _params(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=3, temperature=1.0, top_k=TOP_K, seed=seed,
                          ignore_eos=True)


def _target_probs(llm: LLM, prompt: list[int], out: list[int]) -> list[float]:
    """The target's sampling distribution of the token after `prompt + out` (top-k applied)."""
    logits = llm.engine.prompt_logits(prompt + out)[-1:]
    row = SamplingRow(_params(0), prompt, out, 0, len(out), frozenset())
    p = Sampler().probs(logits, [row])[0]
    return p.tolist()


def _cells(counts: Counter, probs: list[float]) -> tuple[list[int], list[float]]:
    support = [t for t, q in enumerate(probs) if q > 0]
    assert sum(counts.values()) == sum(counts[t] for t in support), "emitted outside top-k"
    return [counts[t] for t in support], [probs[t] for t in support]


def test_eagle_speculation_keeps_the_target_distribution(tiny_llama, fitted_eagle):
    prompt = fit_prompts(VOCAB)[0]
    llm = LLM(str(tiny_llama), dtype="float32", num_gpu_blocks=4096, max_num_seqs=512,
              max_num_batched_tokens=2048, speculative_config={
                  "method": "eagle", "model": str(fitted_eagle), "num_speculative_tokens": 2,
                  "adaptive": False})
    with torch.inference_mode():
        outs = [o.token_ids for o in llm.generate([prompt] * N, [_params(i) for i in range(N)])]
    stats = llm.engine.stats()
    assert 0.05 < stats["spec_acceptance_rate"] < 0.95, stats["spec_acceptance_rate"]
    first = Counter(o[0] for o in outs)
    assert chi2_pvalue(*_cells(first, _target_probs(llm, prompt, []))) > ALPHA
    t1 = first.most_common(1)[0][0]
    second = Counter(o[1] for o in outs if o[0] == t1)
    assert chi2_pvalue(*_cells(second, _target_probs(llm, prompt, [t1]))) > ALPHA
    t2 = second.most_common(1)[0][0]
    third = Counter(o[2] for o in outs if o[:2] == [t1, t2])
    assert sum(third.values()) > 300
    assert chi2_pvalue(*_cells(third, _target_probs(llm, prompt, [t1, t2]))) > ALPHA
