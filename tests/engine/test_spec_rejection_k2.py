"""Rejection sampling with two drafts per round: the second emitted token follows the target's
distribution at its position, given the first (see test_spec_rejection.py for the setup).

Power (alpha = 1e-3): the marginal of the second token is tested on N = 40000 requests (power
> 0.9999 against a 2% shift); conditionally on the most likely first token, n ~ 0.30 N =
12000: noncentrality 12000 * 0.02^2 * (1/0.25 + 1/0.25) = 38.4 for a 2% shift between the two
most likely second tokens (p = 0.25 each), detected with probability 0.96 (df = 7, critical
value 24.3).
"""

from __future__ import annotations

from collections import Counter

from tests.engine.test_spec_rejection import (  # noqa: F401 - one_thread is a fixture
    ALPHA,
    P,
    chi2_pvalue,
    first_token_counts,
    one_thread,
    simulate,
)


def test_second_token_follows_p_given_the_first_with_two_drafts():
    emitted = simulate(40000, k=2, seed0=2 * 10**6)
    assert chi2_pvalue(first_token_counts(emitted), P[0].tolist()) > ALPHA
    second = Counter(e[1] for e in emitted)
    assert chi2_pvalue([second[t] for t in range(8)], P[1].tolist()) > ALPHA
    after_0 = Counter(e[1] for e in emitted if e[0] == 0)
    assert sum(after_0.values()) > 10000
    assert chi2_pvalue([after_0[t] for t in range(8)], P[1].tolist()) > ALPHA
