"""Rejection sampling keeps the target distribution exactly; greedy verification is exact match.

The statistical tests drive `rejection_sample` the way the engine does — drafts drawn from q
on the drafter's stream, a new round starting after the last emitted token — with fixed,
position-dependent target p and draft q over a vocabulary of 8, and many independent requests
(one seed each). Seeds are fixed, so each test is deterministic.

Power (computed with numpy's noncentral chi-square, alpha = 1e-3): the hardest 2% deviation
to detect moves 0.02 of mass between the two most likely tokens (p = 0.30 and 0.20 below):
noncentrality N * 0.02^2 * (1/0.30 + 1/0.20) = 66.7 at N = 20000, and a chi-square test with
6-7 degrees of freedom (critical value 22.5-24.3) detects it with probability 0.9999 (0.93 at
N = 10000). The second position (two drafts per round) is tested in test_spec_rejection_k2.py.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from pdserve.engine.sampler import Sampler, SamplingRow
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.spec import rejection
from pdserve.engine.spec.rejection import (
    DRAFT_STREAM,
    VerifyItem,
    accept_greedy,
    rejection_sample,
)

ALPHA = 1e-3


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Thousands of tiny tensor ops: a second thread only oversubscribes a shared machine.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

SAMPLED = SamplingParams(temperature=1.0)

# Position-dependent target p and draft q (rows: positions 0..3). Token 7 is impossible for
# the target at position 0 but the drafter proposes it; token 2 is one the drafter never
# proposes at position 0: the residual must supply it.
P = torch.tensor([
    [0.30, 0.20, 0.15, 0.12, 0.10, 0.08, 0.05, 0.00],
    [0.05, 0.10, 0.25, 0.05, 0.20, 0.05, 0.25, 0.05],
    [0.10, 0.10, 0.10, 0.30, 0.10, 0.10, 0.10, 0.10],
    [0.40, 0.05, 0.05, 0.05, 0.05, 0.20, 0.10, 0.10],
])
Q = torch.tensor([
    [0.05, 0.25, 0.00, 0.30, 0.10, 0.10, 0.10, 0.10],
    [0.20, 0.10, 0.10, 0.10, 0.20, 0.10, 0.10, 0.10],
    [0.05, 0.05, 0.50, 0.05, 0.05, 0.10, 0.10, 0.10],
    [0.125] * 8,
])


def chi2_pvalue(counts: list[int], probs: list[float]) -> float:
    """Pearson chi-square test of counts against probs (cells with p = 0 must be empty)."""
    n = sum(counts)
    stat, df = 0.0, -1
    for c, p in zip(counts, probs, strict=True):
        if p == 0:
            assert c == 0, "a token with target probability 0 was emitted"
            continue
        stat += (c - n * p) ** 2 / (n * p)
        df += 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def simulate(n: int, k: int, one_hot_draft: int | None = None, seed0: int = 0
             ) -> list[list[int]]:
    """First two emitted tokens of n requests, speculating k drafts per round."""
    sampler = Sampler()
    emitted: list[list[int]] = [[] for _ in range(n)]
    while True:
        todo = [i for i in range(n) if len(emitted[i]) < 2]
        if not todo:
            return emitted
        step = {i: len(emitted[i]) for i in todo}
        rows = {i: [SamplingRow(SAMPLED, [1], [], seed0 + i, step[i] + j) for j in range(k + 1)]
                for i in todo}
        drafts = {i: [] for i in todo}
        for j in range(k):
            if one_hot_draft is not None:
                for i in todo:
                    drafts[i].append(one_hot_draft)
                continue
            q = torch.stack([Q[step[i] + j] for i in todo])
            toks = sampler.sample_from_probs(q, [rows[i][j] for i in todo], stream=DRAFT_STREAM)
            for i, t in zip(todo, toks, strict=True):
                drafts[i].append(t)
        items = [VerifyItem(drafts[i], rows[i], n_ * (k + 1),
                            None if one_hot_draft is not None else Q[step[i]:step[i] + k])
                 for n_, i in enumerate(todo)]
        p = torch.cat([P[step[i]:step[i] + k + 1] for i in todo])
        for i, toks in zip(todo, rejection_sample(p, items, sampler), strict=True):
            emitted[i].extend(toks)


def first_token_counts(emitted: list[list[int]]) -> list[int]:
    c = Counter(e[0] for e in emitted)
    return [c[t] for t in range(8)]


def test_first_token_follows_p_with_one_draft():
    emitted = simulate(20000, k=1)
    assert chi2_pvalue(first_token_counts(emitted), P[0].tolist()) > ALPHA


def test_first_token_follows_p_with_a_deterministic_draft():
    # An n-gram drafter proposes one fixed token: q is one-hot there.
    emitted = simulate(20000, k=1, one_hot_draft=3, seed0=10**6)
    assert chi2_pvalue(first_token_counts(emitted), P[0].tolist()) > ALPHA


def test_the_statistical_test_catches_a_biased_resample(monkeypatch):
    # A classic bug: resampling from p instead of max(0, p - q) after a rejection. The same
    # test must reject it, or it could not tell a right sampler from a wrong one.
    monkeypatch.setattr(rejection, "_residuals",
                        lambda p, items, at: p[torch.tensor([it.offset + j for it, j
                                                             in zip(items, at, strict=True)])])
    emitted = simulate(20000, k=1)
    assert chi2_pvalue(first_token_counts(emitted), P[0].tolist()) < 1e-6


def test_draws_depend_only_on_seed_and_step_not_on_the_batch():
    sampler = Sampler()
    rows = [SamplingRow(SAMPLED, [1], [], s, 5 + j) for s in (11, 12, 13) for j in range(3)]
    items = [VerifyItem([1, 3], rows[3 * i:3 * i + 3], 3 * i, Q[:2]) for i in range(3)]
    p = P[:3].repeat(3, 1)
    together = rejection_sample(p, items, sampler)
    alone = [rejection_sample(P[:3], [VerifyItem([1, 3], rows[3 * i:3 * i + 3], 0, Q[:2])],
                              sampler)[0] for i in range(3)]
    assert together == alone
    reversed_items = [VerifyItem(it.draft, it.rows, 3 * (2 - i), it.draft_probs)
                      for i, it in enumerate(items)][::-1]
    assert rejection_sample(torch.cat([P[:3]] * 3), reversed_items, sampler) == together[::-1]


def test_a_draft_the_target_cannot_emit_is_always_rejected():
    sampler = Sampler()
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    for seed in range(200):
        rows = [SamplingRow(SAMPLED, [1], [], seed, j) for j in range(2)]
        out = rejection_sample(p, [VerifyItem([2], rows, 0, None)], sampler)[0]
        assert len(out) == 1 and out[0] in (0, 1)


def test_accept_greedy_takes_the_matching_prefix_then_the_target_token():
    assert accept_greedy([5, 6, 7], [5, 6, 9, 1]) == [5, 6, 9]
    assert accept_greedy([5, 6, 7], [4, 6, 7, 1]) == [4]
    assert accept_greedy([5, 6, 7], [5, 6, 7, 1]) == [5, 6, 7, 1]


@pytest.mark.parametrize("bad", [[[0.5, 0.5]], [[0.2, 0.3, 0.5], [0.2, 0.3, 0.5]]])
def test_proposal_rejects_mismatched_draft_probs(bad):
    from pdserve.engine.spec.proposer import Proposal

    with pytest.raises(ValueError):
        Proposal([1, 2, 3], torch.tensor(bad))
    with pytest.raises(ValueError):
        Proposal([])
