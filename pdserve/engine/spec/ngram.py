"""N-gram (prompt lookup) drafter: no model, the context predicts itself.

For n from `max_n` down to `min_n`, take the request's last n tokens (prompt + output) and find
their most recent earlier occurrence; propose the k tokens that followed it. The first n that
matches wins. When the match is fewer than k tokens back, the copy runs on over its own
proposals (a run like `a b a b` proposes `a b a b ...`, not just the `a b` still in context).
Proposals are deterministic, so q is one-hot (`draft_probs=None`).

Cost: one backward scan over the context per request per step, visiting only positions that
hold the last token; `max_context` bounds the scan on very long contexts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pdserve.engine.request import Request
from pdserve.engine.spec.proposer import Proposal, Proposer


class NgramProposer(Proposer):
    draft_cost_ratio = 0.0

    def __init__(self, max_n: int, min_n: int = 1, max_context: int = 8192) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{min_n}, {max_n}")
        self.max_n = max_n
        self.min_n = min_n
        self.max_context = max_context

    def propose(self, requests: Sequence[Request], k: Mapping[str, int]
                ) -> dict[str, Proposal]:
        out: dict[str, Proposal] = {}
        for req in requests:
            want = k.get(req.request_id, 0)
            if want <= 0:
                continue
            start = max(0, req.num_tokens - self.max_context)
            tokens = lookup(req.token_slice(start, req.num_tokens), want, self.max_n, self.min_n)
            if tokens:
                out[req.request_id] = Proposal(tokens)
        return out


def lookup(tokens: Sequence[int], k: int, max_n: int, min_n: int = 1) -> list[int]:
    """The k tokens after the most recent earlier occurrence of the longest matching suffix
    n-gram (n in [min_n, max_n]), or [] when nothing matches."""
    length = len(tokens)
    if length < min_n + 1:
        return []
    last = tokens[-1]
    # best_end[n] = end index (inclusive) of the most recent earlier match of length >= n.
    best_end: dict[int, int] = {}
    for end in range(length - 2, min_n - 2, -1):
        if tokens[end] != last:
            continue
        m = _match_length(tokens, end, max_n)
        for n in range(min_n, m + 1):
            best_end.setdefault(n, end)
        if m >= max_n:
            break  # nothing can beat a full-length match that is also the most recent
    for n in range(max_n, min_n - 1, -1):
        if n in best_end:
            return _copy(tokens, best_end[n], k)
    return []


def _copy(tokens: Sequence[int], end: int, k: int) -> list[int]:
    """k tokens following `end`, copied LZ77-style: past the end of `tokens` the copy runs on
    over the tokens it has already proposed, so a pattern repeating with period d (the match
    is d tokens back) is proposed in full rather than cut after d tokens."""
    length = len(tokens)
    distance = length - 1 - end
    out: list[int] = []
    for i in range(k):
        src = length + i - distance
        out.append(tokens[src] if src < length else out[src - length])
    return out


def _match_length(tokens: Sequence[int], end: int, max_n: int) -> int:
    """How many tokens ending at `end` equal the suffix of `tokens` (at most max_n)."""
    length = len(tokens)
    m = 0
    while m < max_n and end - m >= 0 and tokens[end - m] == tokens[length - 1 - m]:
        m += 1
    return m
