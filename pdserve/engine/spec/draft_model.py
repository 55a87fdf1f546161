"""Draft-model drafter: a smaller model sharing the target's tokenizer, with its own paged KV
cache and block pool, run autoregressively for k steps per target step.

The draft is a second `LLMEngine` (same device, dtype and block size as the target, no prefix
caching, no speculation of its own); this class uses only its model runner and block pool and
keeps its own per-request state (`_DraftSeq`). Its scheduler is never used.

Draft KV of a request:

    first proposal ──► catch-up: prefill the whole context (prompt + output so far)
        │               (bounded by `catchup_budget` tokens per step; unfinished ⇒ no drafts)
        ▼
    each proposal: feed the tokens after the last confirmed one, sample d_1, feed d_1,
        sample d_2, ... d_k; the KV of d_1..d_{k-1} is written at their positions
        ▼
    next proposal: the leading fed drafts that the target emitted are confirmed; the rest is
        overwritten in place (same positions, same blocks)
    finish / preemption ──► blocks back to the draft pool

Catch-up is how the draft gets KV for requests that arrived with KV computed elsewhere: a
decode worker receives the target's prompt KV from a prefill worker, the draft never saw the
prompt, so the first proposal for such a request prefills it into the draft cache. The same
path serves requests prefilled locally (the draft does not run during target prefill, which
keeps prefill steps as fast as without speculation) and requests recomputed after preemption.
When the draft pool runs out of blocks a request simply gets no drafts that step.

Draws: greedy requests (and every request with `greedy=True`) draft the argmax, q one-hot;
sampled requests draft with their own parameters on `DRAFT_STREAM`, q = that distribution.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pdserve.engine.kv_manager import cdiv
from pdserve.engine.request import Request
from pdserve.engine.sampler import SamplingRow
from pdserve.engine.scheduler import ScheduledChunk
from pdserve.engine.spec.proposer import Proposal, Proposer
from pdserve.engine.spec.rejection import DRAFT_STREAM

if TYPE_CHECKING:
    from pdserve.engine.engine import LLMEngine


@dataclass
class _DraftSeq:
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    """Leading tokens of the request whose draft KV is known to be right."""
    unconfirmed: list[int] = field(default_factory=list)
    """Drafts fed at positions num_computed, ... last time (right only if the target agrees)."""


@dataclass
class _Work:
    """One request's drafting in one `propose` call."""

    req: Request
    seq: _DraftSeq
    k: int
    feed: list[int]
    """Tokens fed in the first forward (catch-up plus the request's last token)."""
    complete: bool
    """The feed reaches the last token, so the first forward yields d_1."""
    drafts: list[int] = field(default_factory=list)
    probs: list[torch.Tensor | None] = field(default_factory=list)


class DraftModelProposer(Proposer):
    def __init__(self, draft: LLMEngine, eos_token_ids: frozenset[int], greedy: bool = False,
                 catchup_budget: int = 1024, draft_cost_ratio: float = 0.0) -> None:
        self.draft = draft
        self.runner = draft.runner
        self.pool = draft.pool
        self.block_size = draft.config.block_size
        self.eos_token_ids = eos_token_ids
        self.greedy = greedy
        self.catchup_budget = catchup_budget
        self.draft_cost_ratio = draft_cost_ratio
        self._seqs: dict[str, _DraftSeq] = {}

    # -- lifecycle hooks -------------------------------------------------------------------
    def on_finish(self, request_id: str) -> None:
        self._drop(request_id)

    def on_preempt(self, request_id: str) -> None:
        self._drop(request_id)

    def is_idle(self) -> bool:
        return not self._seqs and self.pool.is_idle()

    def kv_state(self, request_id: str) -> tuple[list[int], int] | None:
        """(draft block ids, leading tokens whose draft KV is right) of a request, or None
        when the draft holds nothing for it. For introspection and tests."""
        seq = self._seqs.get(request_id)
        return None if seq is None else (list(seq.block_ids), seq.num_computed)

    def _drop(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.pool.free(list(reversed(seq.block_ids)))

    # -- proposing ---------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], k: Mapping[str, int]
                ) -> dict[str, Proposal]:
        work = self._prepare(requests, k)
        if not work:
            return {}
        chunks = [ScheduledChunk(w.req.request_id, w.feed, w.seq.num_computed, w.seq.block_ids,
                                 1 if w.complete else 0) for w in work]
        logits = self.runner.logits(chunks)
        active = [w for w in work if w.complete]
        if active:
            self._sample(active, logits)
        for j in range(1, max((w.k for w in active), default=0)):
            active = [w for w in active if w.k > j]
            chunks = [ScheduledChunk(w.req.request_id, [w.drafts[-1]], w.req.num_tokens + j - 1,
                                     w.seq.block_ids, 1) for w in active]
            self._sample(active, self.runner.logits(chunks))
        return self._finish(work)

    def _prepare(self, requests: Sequence[Request], k: Mapping[str, int]) -> list[_Work]:
        work: list[_Work] = []
        budget = self.catchup_budget
        for req in requests:
            want = k.get(req.request_id, 0)
            if want <= 0:
                continue
            seq = self._seqs.get(req.request_id) or _DraftSeq()
            _confirm(seq, req)
            missing = req.num_tokens - seq.num_computed
            # The last token is always fed; only the catch-up before it counts against budget.
            take = min(missing, max(budget, 0) + 1) if missing > 1 else missing
            complete = take == missing
            end = req.num_tokens + want - 1 if complete else seq.num_computed + take
            if not self._grow(seq, cdiv(end, self.block_size)):
                if not seq.block_ids:
                    self._seqs.pop(req.request_id, None)
                continue
            self._seqs[req.request_id] = seq
            budget -= take - 1
            feed = req.token_slice(seq.num_computed, seq.num_computed + take)
            work.append(_Work(req, seq, want, feed, complete))
        return work

    def _grow(self, seq: _DraftSeq, num_blocks: int) -> bool:
        need = num_blocks - len(seq.block_ids)
        if need <= 0:
            return True
        new = self.pool.allocate(need)
        if new is None:
            return False
        seq.block_ids.extend(new)
        return True

    def _sample(self, active: Sequence[_Work], logits: torch.Tensor) -> None:
        """Draw each active request's next draft token from its row of `logits`."""
        rows = [self._row(w) for w in active]
        greedy = [i for i, w in enumerate(active) if w.req.params.is_greedy]
        forced = [i for i, w in enumerate(active)
                  if self.greedy and not w.req.params.is_greedy]
        drawn = [i for i, w in enumerate(active) if not self.greedy and not w.req.params.is_greedy]
        tokens: dict[int, int] = {}
        probs: dict[int, torch.Tensor] = {}
        if greedy:
            out = self.runner.sampler(_take(logits, greedy), [rows[i] for i in greedy])
            tokens.update(zip(greedy, out.token_ids, strict=True))
        if forced:
            p = self.runner.sampler.probs(_take(logits, forced), [rows[i] for i in forced])
            tokens.update(zip(forced, p.argmax(dim=-1).tolist(), strict=True))
        if drawn:
            sub_rows = [rows[i] for i in drawn]
            p = self.runner.sampler.probs(_take(logits, drawn), sub_rows)
            toks = self.runner.sampler.sample_from_probs(p, sub_rows, stream=DRAFT_STREAM)
            tokens.update(zip(drawn, toks, strict=True))
            probs.update((i, p[n]) for n, i in enumerate(drawn))
        for i, w in enumerate(active):
            w.drafts.append(tokens[i])
            w.probs.append(probs.get(i))

    def _row(self, w: _Work) -> SamplingRow:
        out = w.req.output_token_ids + w.drafts
        return SamplingRow(w.req.params, w.req.prompt_token_ids, out, w.req.seed, len(out),
                           self.eos_token_ids)

    def _finish(self, work: Sequence[_Work]) -> dict[str, Proposal]:
        """Record what the draft cache now holds; turn the drafts into proposals."""
        out: dict[str, Proposal] = {}
        for w in work:
            w.seq.num_computed += len(w.feed)
            if not w.complete:
                continue
            w.seq.unconfirmed = w.drafts[:-1]  # d_k was sampled, never fed
            # A request's drafts are all drawn or all argmax: its params decide, not the round.
            q = torch.stack(w.probs) if w.probs[0] is not None else None
            out[w.req.request_id] = Proposal(list(w.drafts), q)
        return out


def _confirm(seq: _DraftSeq, req: Request) -> None:
    """Keep the fed drafts that the target emitted; at least the last token is refed."""
    if seq.unconfirmed:
        start = seq.num_computed
        actual = req.token_slice(start, min(start + len(seq.unconfirmed), req.num_tokens))
        n = 0
        while n < len(actual) and actual[n] == seq.unconfirmed[n]:
            n += 1
        seq.num_computed += n
        seq.unconfirmed = []
    seq.num_computed = min(seq.num_computed, req.num_tokens - 1)


def _take(logits: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    if len(rows) == logits.shape[0]:
        return logits
    return logits[torch.tensor(list(rows), device=logits.device)]
