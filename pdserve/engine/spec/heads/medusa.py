"""Medusa heads (`"method": "medusa"`), in the checkpoint layout vLLM loads, and their drafter.

config.json: `num_heads` heads, `num_hidden_layers` residual layers each, `hidden_size`,
`vocab_size`, optionally `truncated_vocab_size` with a `token_map` tensor (the draft
vocabulary's target ids), `medusa_fc_bias`, `original_lm_head` (one LM head for all).
Weights (an optional `medusa_heads.` prefix is dropped): `blocks.<i>.layers.<j>.weight`
(+ `.bias`), `lm_heads.<i>.weight` (or `lm_head.weight`).

    head i: x = f; x = x + silu(W_ij x) for each layer j; logits_i = lm_head_i(x)

f is the target's final hidden state at the last verified position (the one that predicted
the token just emitted); head i proposes the token i + 1 places after that one. No attention,
no KV: a request needs only the last feature, so the chain is a single pass over its heads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampler import Sampler, SamplingRow
from pdserve.engine.scheduler import ScheduledChunk
from pdserve.engine.spec.draws import draw_drafts
from pdserve.engine.spec.features import FeatureSpec, StepFeatures
from pdserve.engine.spec.heads.base import load_into
from pdserve.engine.spec.proposer import Proposal, Proposer


class _ResidualBlock(nn.Module):
    def __init__(self, hidden: int, layers: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden, bias=bias, dtype=dtype)
                                    for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


class MedusaHeads(nn.Module):
    def __init__(self, raw: dict[str, Any], dtype: torch.dtype, vocab_size: int) -> None:
        super().__init__()
        h = int(raw["hidden_size"])
        self.num_heads = int(raw["num_heads"])
        self.vocab_size = vocab_size
        draft_vocab = int(raw.get("truncated_vocab_size") or raw.get("vocab_size") or vocab_size)
        self.blocks = nn.ModuleList(
            _ResidualBlock(h, int(raw.get("num_hidden_layers", 1)),
                           bool(raw.get("medusa_fc_bias", False)), dtype)
            for _ in range(self.num_heads))
        shared = bool(raw.get("original_lm_head", False))
        self.lm_heads = nn.ModuleList(nn.Linear(h, draft_vocab, bias=False, dtype=dtype)
                                      for _ in range(1 if shared else self.num_heads))
        self.register_buffer("token_map", torch.arange(draft_vocab, dtype=torch.int64))
        self.truncated = draft_vocab != vocab_size

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        """[B, H] -> [num_heads, B, V] fp32 logits over the target vocabulary."""
        outs = []
        for i, block in enumerate(self.blocks):
            lm = self.lm_heads[min(i, len(self.lm_heads) - 1)]
            small = lm(block(feats)).float()
            if self.truncated:
                full = small.new_full((feats.shape[0], self.vocab_size), float("-inf"))
                full[:, self.token_map] = small
                small = full
            outs.append(small)
        return torch.stack(outs)

    @classmethod
    def build(cls, raw: dict[str, Any], weights: dict[str, torch.Tensor], dtype: torch.dtype,
              vocab_size: int) -> MedusaHeads:
        heads = cls(raw, dtype, vocab_size)
        named = {k.removeprefix("medusa_heads."): v for k, v in weights.items()}
        token_map = named.pop("token_map", None)
        if heads.truncated:
            if token_map is None or token_map.numel() != heads.token_map.numel():
                raise ValueError("a Medusa checkpoint with truncated_vocab_size needs a "
                                 "token_map of that many target ids")
            heads.token_map.copy_(token_map.to(torch.int64))
        if "lm_head.weight" in named:
            named["lm_heads.0.weight"] = named.pop("lm_head.weight")
        load_into(heads, named.items())
        return heads


class MedusaProposer(Proposer):
    """Proposes from the last verified position's target feature (kept per request)."""

    def __init__(self, heads: MedusaHeads, sampler: Sampler, eos_token_ids: frozenset[int],
                 greedy: bool = False, draft_cost_ratio: float = 0.0) -> None:
        self.heads = heads
        self.sampler = sampler
        self.eos_token_ids = eos_token_ids
        self.greedy = greedy
        self.draft_cost_ratio = draft_cost_ratio
        self.feature_spec = FeatureSpec()
        self._last: dict[str, tuple[int, torch.Tensor]] = {}  # rid -> (position, feature)

    def extend(self, chunks: Sequence[ScheduledChunk], features: StepFeatures,
               requests: Mapping[str, Request]) -> None:
        for ci, c in enumerate(chunks):
            req = requests.get(c.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue
            last = min(req.num_computed_tokens, c.start + len(c.token_ids)) - 1
            if last >= c.start:
                self._last[c.request_id] = (last, features.rows(ci, last - c.start,
                                                                last - c.start + 1).hidden)

    def propose(self, requests: Sequence[Request], k: Mapping[str, int]
                ) -> dict[str, Proposal]:
        # The feature must be the one that predicted the request's last token.
        ready = [r for r in requests if k.get(r.request_id, 0) > 0
                 and self._last.get(r.request_id, (-1,))[0] == r.num_tokens - 2]
        if not ready:
            return {}
        feats = torch.cat([self._last[r.request_id][1] for r in ready])
        logits = self.heads(feats)  # [heads, B, V]
        depth = min(self.heads.num_heads, max(k[r.request_id] for r in ready))
        drafts: dict[str, list[int]] = {r.request_id: [] for r in ready}
        probs: dict[str, list[torch.Tensor | None]] = {r.request_id: [] for r in ready}
        for j in range(depth):
            rows = [self._row(r, drafts[r.request_id]) for r in ready]
            toks, qs = draw_drafts(self.sampler, logits[j], rows, self.greedy)
            for r, t, q in zip(ready, toks, qs, strict=True):
                if j < k[r.request_id]:
                    drafts[r.request_id].append(t)
                    probs[r.request_id].append(q)
        out = {}
        for r in ready:
            q = probs[r.request_id]
            out[r.request_id] = Proposal(drafts[r.request_id],
                                         torch.stack(q) if q[0] is not None else None)
        return out

    def _row(self, req: Request, drafts: list[int]) -> SamplingRow:
        out = req.output_token_ids + drafts
        return SamplingRow(req.params, req.prompt_token_ids, out, req.seed, len(out),
                           self.eos_token_ids)

    def on_finish(self, request_id: str) -> None:
        self._last.pop(request_id, None)

    def on_preempt(self, request_id: str) -> None:
        self._last.pop(request_id, None)

    def is_idle(self) -> bool:
        return not self._last
