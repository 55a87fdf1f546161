"""Chain drafting with a learned head that attends over its own KV (EAGLE, EAGLE-3, MTP).

The head's paged KV holds one row per target position i, computed from (token at i + 1,
target feature f_i). After every target step the engine hands over that step's features
(`extend`), and the head catches up over the positions the step confirmed:

    target step computed [a, m) ─► extend: feed (x_{a+1}, f_a) .. (x_m, f_{m-1}) at a .. m-1
        (one batched head forward for every request of the step: prefill chunks too)
        └► a request now decoding keeps the logits of its last row: they predict d_1
    propose(k): d_1 from those logits; then k - 1 chained single-token steps feed
        (d_j, the head's own output feature) at m - 1 + j ─► d_{j+1}
    next step verifies [x_m, d_1..d_k]: the confirmed positions overwrite the chained rows

Draft context: a request's head KV starts at the first position whose target feature this
engine saw (`_Seq.start`). A request prefilled here sees its whole prompt; one whose prompt
KV came from a prefill worker or a prefix-cache hit starts at the hand-off (the decode
worker rebuilds the drafter's state from its own forwards: nothing but KV crosses the wire,
and drafts stay exact through verification, only less likely to be accepted in the first
steps). A gap (a step the head skipped for lack of blocks, a preemption) restarts the
context the same way. Rows are written at local slots (position - start) while rotary uses
the true positions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from kv_store.block_pool import BlockPool
from pdserve.engine.attention.backend import AttentionBackend
from pdserve.engine.kv_manager import cdiv
from pdserve.engine.model_runner import build_inputs
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampler import Sampler, SamplingRow
from pdserve.engine.scheduler import ScheduledChunk
from pdserve.engine.spec.draws import draw_drafts
from pdserve.engine.spec.features import StepFeatures
from pdserve.engine.spec.heads.base import DraftHead
from pdserve.engine.spec.proposer import Proposal, Proposer


@dataclass
class _Seq:
    start: int
    """First target position with head KV (the head's context starts here)."""
    num_computed: int
    """Head KV is right for positions [start, num_computed)."""
    block_ids: list[int] = field(default_factory=list)
    feature: torch.Tensor | None = None
    """The head's output feature at position num_computed - 1 (fed by the first chained
    step), with `logits` its prediction of d_1; both None once used."""
    logits: torch.Tensor | None = None


@dataclass
class _Row:
    """One request's share of a batched head forward."""

    rid: str
    seq: _Seq
    token_ids: list[int]
    position: int  # of the first token
    feats: torch.Tensor


class FeatureProposer(Proposer):
    def __init__(self, head: DraftHead, caches: list[torch.Tensor], pool: BlockPool,
                 block_size: int, backend: AttentionBackend, sampler: Sampler,
                 eos_token_ids: frozenset[int], greedy: bool = False,
                 draft_cost_ratio: float = 0.0) -> None:
        self.head = head
        self.caches = caches
        self.pool = pool
        self.block_size = block_size
        self.backend = backend
        self.sampler = sampler
        self.eos_token_ids = eos_token_ids
        self.greedy = greedy
        self.draft_cost_ratio = draft_cost_ratio
        self.feature_spec = head.feature_spec
        self._seqs: dict[str, _Seq] = {}

    # -- lifecycle ---------------------------------------------------------------------------
    def on_finish(self, request_id: str) -> None:
        self._drop(request_id)

    def on_preempt(self, request_id: str) -> None:
        self._drop(request_id)

    def is_idle(self) -> bool:
        return not self._seqs and self.pool.is_idle()

    def context(self, request_id: str) -> tuple[int, int] | None:
        """(first, end) target positions the head holds KV for, or None (tests, stats)."""
        s = self._seqs.get(request_id)
        return None if s is None else (s.start, s.num_computed)

    def _drop(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None and seq.block_ids:
            self.pool.free(list(reversed(seq.block_ids)))

    def _grow(self, seq: _Seq, end: int) -> bool:
        """Blocks for positions [start, end); False (nothing taken) if the pool is short."""
        need = cdiv(end - seq.start, self.block_size) - len(seq.block_ids)
        if need <= 0:
            return True
        new = self.pool.allocate(need)
        if new is None:
            return False
        seq.block_ids.extend(new)
        return True

    # -- after each target step ------------------------------------------------------------------
    @torch.inference_mode()
    def extend(self, chunks: Sequence[ScheduledChunk], features: StepFeatures,
               requests: Mapping[str, Request]) -> None:
        rows = []
        for ci, c in enumerate(chunks):
            req = requests.get(c.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue
            a, m = c.start, min(req.num_computed_tokens, c.start + len(c.token_ids))
            if m <= a:
                continue
            seq = self._seqs.get(c.request_id)
            if seq is None or seq.num_computed != a:  # new, or a gap: the context restarts
                self._drop(c.request_id)
                seq = _Seq(start=a, num_computed=a)
            if not self._grow(seq, m):
                self._drop(c.request_id)
                continue
            self._seqs[c.request_id] = seq
            feats = self.head.target_features(features.rows(ci, 0, m - a))
            rows.append(_Row(c.request_id, seq, req.token_slice(a + 1, m + 1), a, feats))
        if not rows:
            return
        outs, nexts = self._forward(rows)
        ends = torch.tensor([len(r.token_ids) for r in rows]).cumsum(0) - 1
        for i, r in enumerate(rows):
            r.seq.num_computed = r.position + len(r.token_ids)
            decoding = requests[r.rid].num_tokens == r.seq.num_computed + 1
            r.seq.feature = nexts[ends[i]:ends[i] + 1] if decoding else None
            r.seq.logits = self.head.logits(outs[ends[i]:ends[i] + 1]) if decoding else None

    def _forward(self, rows: Sequence[_Row]) -> tuple[torch.Tensor, torch.Tensor]:
        """One head forward over every row's tokens (KV at local slots, true positions)."""
        chunks = [ScheduledChunk(r.rid, r.token_ids, r.position - r.seq.start, r.seq.block_ids, 0)
                  for r in rows]
        device = self.caches[0].device
        batch = build_inputs(chunks, self.block_size, device)
        shift = torch.tensor([r.seq.start for r in rows], device=device).repeat_interleave(
            torch.tensor([len(r.token_ids) for r in rows], device=device))
        feats = torch.cat([r.feats for r in rows])
        return self.head(batch.input_ids, batch.positions + shift, feats, self.caches,
                         batch.meta, self.backend)

    # -- proposing -------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], k: Mapping[str, int]
                ) -> dict[str, Proposal]:
        active = []
        for req in requests:
            seq = self._seqs.get(req.request_id)
            if (k.get(req.request_id, 0) > 0 and seq is not None and seq.logits is not None
                    and seq.num_computed == req.num_tokens - 1
                    and self._grow(seq, req.num_tokens + k[req.request_id] - 2)):
                active.append((req, seq))
        if not active:
            return {}
        drafts: dict[str, list[int]] = {r.request_id: [] for r, _ in active}
        probs: dict[str, list[torch.Tensor | None]] = {r.request_id: [] for r, _ in active}
        logits = torch.cat([s.logits for _, s in active])
        feats = torch.cat([s.feature for _, s in active])
        for j in range(max(k[r.request_id] for r, _ in active)):
            if j:  # (d_j, the head's feature) at position m - 1 + j
                outs, feats = self._forward([
                    _Row(r.request_id, s, [drafts[r.request_id][-1]], r.num_tokens - 2 + j,
                         feats[i:i + 1]) for i, (r, s) in enumerate(active)])
                logits = self.head.logits(outs)
            toks, qs = draw_drafts(self.sampler, logits,
                                   [self._row(r, drafts[r.request_id]) for r, _ in active],
                                   self.greedy)
            for (r, _), t, q in zip(active, toks, qs, strict=True):
                drafts[r.request_id].append(t)
                probs[r.request_id].append(q)
            keep = [i for i, (r, _) in enumerate(active) if k[r.request_id] > j + 1]
            active = [active[i] for i in keep]
            if not active:
                break
            feats = feats[torch.tensor(keep, device=feats.device)]
        for seq in (self._seqs[rid] for rid in drafts):
            seq.feature = seq.logits = None
        return {rid: Proposal(d, torch.stack(probs[rid]) if probs[rid][0] is not None
                              else None) for rid, d in drafts.items()}

    def _row(self, req: Request, drafts: list[int]) -> SamplingRow:
        out = req.output_token_ids + drafts
        return SamplingRow(req.params, req.prompt_token_ids, out, req.seed, len(out),
                           self.eos_token_ids)
