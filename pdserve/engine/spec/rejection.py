"""Verification math of speculative decoding: exact greedy matching and rejection sampling.

Rejection sampling (Leviathan et al., 2023) keeps the target's distribution exactly. For one
request with draft tokens x_1..x_k drawn from q_1..q_k and target distributions p_1..p_{k+1}
(from one target forward over the k + 1 positions):

    for j in 1..k:   accept x_j with probability min(1, p_j(x_j) / q_j(x_j))
                     on the first rejection: emit a draw from normalise(max(0, p_j - q_j)), stop
    all accepted:    emit a bonus draw from p_{k+1}

A deterministic drafter has a one-hot q, so acceptance is p_j(x_j) and the residual is p_j
without x_j. Greedy requests reduce to exact match against the target's argmax, with the
argmax as the correction (or bonus) token.

Randomness: every draw is a function of (request seed, step, stream) only — never of the
batch — through `derive_seed`. Step is the index of the output token the draw decides. The
acceptance uniform, the residual draw and the drafter's own draws use distinct streams, so
they are independent of each other; the bonus draw uses stream 0, the ordinary sampling
stream, so with k = 0 this is exactly the normal sampler. Within one request a (step, stream)
pair decides at most one emitted token: draws after the first rejection are never looked at,
and the next step starts after the last emitted token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.sampler import Sampler, SamplingRow, derive_seed

ACCEPT_STREAM = 1
"""The uniform that accepts or rejects draft token j."""
RESAMPLE_STREAM = 2
"""The draw from the residual max(0, p - q) after a rejection."""
DRAFT_STREAM = 3
"""The drafter's own sampling of draft tokens (a draft model run with the request's params)."""


@dataclass(frozen=True)
class VerifyItem:
    """One request's share of a batched rejection-sampling call."""

    draft: Sequence[int]
    """x_1..x_k (k >= 1)."""
    rows: Sequence[SamplingRow]
    """k + 1 rows (seed, step) for positions 1..k+1."""
    offset: int
    """Row of p_1 in the batched target probabilities."""
    draft_probs: torch.Tensor | None = None
    """[k, V] q_1..q_k; None = one-hot at the draft tokens."""


def accept_greedy(draft: Sequence[int], target: Sequence[int]) -> list[int]:
    """Emitted tokens for a greedy request: the matching prefix of `draft`, then the target's
    token at the first mismatch (or its bonus token after k matches). len(target) = k + 1."""
    out: list[int] = []
    for x, t in zip(draft, target, strict=False):
        out.append(t)
        if x != t:
            return out
    out.append(target[len(draft)])
    return out


def seeded_uniform(row: SamplingRow, stream: int) -> float:
    """u in [0, 1) from (row.seed, row.step, stream) alone."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(derive_seed(row.seed, row.step, stream))
    return float(torch.rand((), generator=gen, dtype=torch.float64))


def rejection_sample(p: torch.Tensor, items: Sequence[VerifyItem], sampler: Sampler
                     ) -> list[list[int]]:
    """Emitted tokens per item. `p` [N, V] holds every item's k + 1 target distributions at
    rows offset..offset+k (non-negative, each row normalised)."""
    if not items:
        return []
    accepted = _num_accepted(p, items)
    out = [list(it.draft[:a]) for it, a in zip(items, accepted, strict=True)]
    rejected = [i for i, (it, a) in enumerate(zip(items, accepted, strict=True))
                if a < len(it.draft)]
    if rejected:
        residual = _residuals(p, [items[i] for i in rejected], [accepted[i] for i in rejected])
        rows = [items[i].rows[accepted[i]] for i in rejected]
        for i, tok in zip(rejected, sampler.sample_from_probs(residual, rows,
                                                               stream=RESAMPLE_STREAM),
                          strict=True):
            out[i].append(tok)
    full = [i for i, (it, a) in enumerate(zip(items, accepted, strict=True))
            if a == len(it.draft)]
    if full:
        idx = torch.tensor([items[i].offset + len(items[i].draft) for i in full],
                           device=p.device)
        rows = [items[i].rows[len(items[i].draft)] for i in full]
        for i, tok in zip(full, sampler.sample_from_probs(p[idx], rows, stream=0), strict=True):
            out[i].append(tok)
    return out


def _num_accepted(p: torch.Tensor, items: Sequence[VerifyItem]) -> list[int]:
    """Leading draft tokens accepted per item; one host sync for p(x) and one for q(x)."""
    rows = [it.offset + j for it in items for j in range(len(it.draft))]
    toks = [x for it in items for x in it.draft]
    dev = p.device
    px = p[torch.tensor(rows, device=dev), torch.tensor(toks, device=dev)].tolist()
    qx = _draft_prob_of_tokens(items, dev)
    accepted: list[int] = []
    at = 0
    for it in items:
        a = 0
        for j in range(len(it.draft)):
            u = seeded_uniform(it.rows[j], ACCEPT_STREAM)
            q = qx[at + j]
            # u < min(1, p/q)  <=>  u * q < p  for q > 0; a token q could not draw is rejected.
            if q <= 0.0 or u * q >= px[at + j]:
                break
            a += 1
        accepted.append(a)
        at += len(it.draft)
    return accepted


def _draft_prob_of_tokens(items: Sequence[VerifyItem], dev: torch.device) -> list[float]:
    """q_j(x_j) for every draft token of every item, in order (1.0 for one-hot drafts)."""
    out = [1.0] * sum(len(it.draft) for it in items)
    with_q = [it for it in items if it.draft_probs is not None]
    if not with_q:
        return out
    q_all = torch.cat([it.draft_probs.to(dev) for it in with_q])  # type: ignore[union-attr]
    toks = torch.tensor([x for it in with_q for x in it.draft], device=dev)
    values = q_all[torch.arange(len(toks), device=dev), toks].tolist()
    at = src = 0
    for it in items:
        n = len(it.draft)
        if it.draft_probs is not None:
            out[at:at + n] = values[src:src + n]
            src += n
        at += n
    return out


def _residuals(p: torch.Tensor, items: Sequence[VerifyItem], at: Sequence[int]) -> torch.Tensor:
    """[n, V] max(0, p_j - q_j) at each item's first rejected position j (unnormalised: the
    sampler's draw normalises). A residual with no mass falls back to p_j (it cannot arise
    with exact arithmetic: a rejection needs p(x) < q(x), so some token has p > q)."""
    dev = p.device
    target = p[torch.tensor([it.offset + j for it, j in zip(items, at, strict=True)],
                            device=dev)]
    q = torch.zeros_like(target)
    one_hot = [r for r, it in enumerate(items) if it.draft_probs is None]
    if one_hot:
        toks = [items[r].draft[at[r]] for r in one_hot]
        q[torch.tensor(one_hot, device=dev), torch.tensor(toks, device=dev)] = 1.0
    drawn = [r for r, it in enumerate(items) if it.draft_probs is not None]
    if drawn:
        q[torch.tensor(drawn, device=dev)] = torch.stack(
            [items[r].draft_probs[at[r]] for r in drawn]).to(dev, target.dtype)  # type: ignore[index]
    residual = (target - q).clamp_min_(0.0)
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    return torch.where(empty, target, residual)
