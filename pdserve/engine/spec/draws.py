"""How a model-based drafter turns its logits into draft tokens and their q.

Greedy requests draft the token the sampler would pick (penalties and min_tokens applied),
q one-hot. Sampled requests draw from their own processed distribution (temperature, top-k/p,
min-p) on `DRAFT_STREAM`, and that distribution is their q, so rejection sampling keeps the
target's distribution exactly; with `force_greedy` they draft its argmax instead (q one-hot).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.engine.sampler import Sampler, SamplingRow
from pdserve.engine.spec.rejection import DRAFT_STREAM


def draw_drafts(sampler: Sampler, logits: torch.Tensor, rows: Sequence[SamplingRow],
                force_greedy: bool = False) -> tuple[list[int], list[torch.Tensor | None]]:
    """One draft token per row of `logits` [N, V], and its q row (None: one-hot)."""
    greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
    sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    tokens: dict[int, int] = {}
    probs: dict[int, torch.Tensor] = {}
    if greedy:
        out = sampler(_take(logits, greedy), [rows[i] for i in greedy])
        tokens.update(zip(greedy, out.token_ids, strict=True))
    if sampled:
        sub = [rows[i] for i in sampled]
        p = sampler.probs(_take(logits, sampled), sub)
        if force_greedy:
            tokens.update(zip(sampled, p.argmax(dim=-1).tolist(), strict=True))
        else:
            drawn = sampler.sample_from_probs(p, sub, stream=DRAFT_STREAM)
            tokens.update(zip(sampled, drawn, strict=True))
            probs.update((i, p[n]) for n, i in enumerate(sampled))
    return [tokens[i] for i in range(len(rows))], [probs.get(i) for i in range(len(rows))]


def _take(logits: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    if len(rows) == logits.shape[0]:
        return logits
    return logits[torch.tensor(list(rows), device=logits.device)]
