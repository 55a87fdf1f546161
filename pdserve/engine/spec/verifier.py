"""One step's sampling when some chunks carry draft tokens: from target logits to the tokens
each request emits (accepted drafts + one correction or bonus token) and their logprobs.

Rows of the step's logits come in chunk order, `num_samples` per sampling chunk (k + 1 for a
chunk with k drafts; `LLMEngine._sampling_rows` builds them with step = len(output) + j).
Three kinds of chunk:

- no drafts:            the ordinary sampler, exactly as without speculation;
- drafts, greedy:       the ordinary sampler gives the target's greedy token at each of the
                        k + 1 positions (penalties and min_tokens included); exact matching;
- drafts, sampled:      `Sampler.probs` gives p at each position; rejection sampling.

The first two kinds share one sampler call; the third one `probs` call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.sampler import Sampler, SamplingRow, TokenLogprobs
from pdserve.engine.sampler import _logprobs as raw_logprobs  # the sampler's own logprob rule
from pdserve.engine.scheduler import ScheduledChunk
from pdserve.engine.spec.proposer import Proposal
from pdserve.engine.spec.rejection import VerifyItem, accept_greedy, rejection_sample


@dataclass(frozen=True)
class Outcome:
    """How one request's drafts fared in one step (before stop rules cut anything)."""

    request_id: str
    num_proposed: int
    num_accepted: int


@dataclass(frozen=True)
class VerifyResult:
    sampled: dict[str, list[int]]
    """Emitted tokens per request, in order."""
    logprobs: dict[str, list[TokenLogprobs | None]]
    outcomes: list[Outcome]


@dataclass(frozen=True)
class _Span:
    chunk: ScheduledChunk
    offset: int  # first row of this chunk in the step's logits


def sample_step(sampler: Sampler, chunks: Sequence[ScheduledChunk], logits: torch.Tensor,
                rows: Sequence[SamplingRow], proposals: Mapping[str, Proposal]
                ) -> VerifyResult:
    spans = _spans(chunks)
    plain = [s for s in spans if not s.chunk.spec_token_ids
             or rows[s.offset].params.is_greedy]
    drafted = [s for s in spans if s.chunk.spec_token_ids
               and not rows[s.offset].params.is_greedy]
    result = VerifyResult({}, {}, [])
    if plain:
        _sample_plain(sampler, plain, logits, rows, result)
    if drafted:
        _sample_drafted(sampler, drafted, logits, rows, proposals, result)
    return result


def _spans(chunks: Sequence[ScheduledChunk]) -> list[_Span]:
    spans: list[_Span] = []
    offset = 0
    for c in chunks:
        if c.num_samples > 0:
            spans.append(_Span(c, offset))
            offset += c.num_samples
    return spans


def _rows_of(spans: Sequence[_Span]) -> list[int]:
    return [s.offset + j for s in spans for j in range(s.chunk.num_samples)]


def _sample_plain(sampler: Sampler, spans: Sequence[_Span], logits: torch.Tensor,
                  rows: Sequence[SamplingRow], result: VerifyResult) -> None:
    idx = _rows_of(spans)
    out = sampler(logits[torch.tensor(idx, device=logits.device)], [rows[i] for i in idx])
    at = 0
    for s in spans:
        n = s.chunk.num_samples
        tokens, lps = out.token_ids[at:at + n], out.logprobs[at:at + n]
        at += n
        draft = s.chunk.spec_token_ids
        rid = s.chunk.request_id
        if draft:
            emitted = accept_greedy(draft, tokens)
            result.outcomes.append(Outcome(rid, len(draft), len(emitted) - 1))
            tokens, lps = emitted, lps[:len(emitted)]
        result.sampled[rid] = list(tokens)
        result.logprobs[rid] = list(lps)


def _sample_drafted(sampler: Sampler, spans: Sequence[_Span], logits: torch.Tensor,
                    rows: Sequence[SamplingRow], proposals: Mapping[str, Proposal],
                    result: VerifyResult) -> None:
    idx = _rows_of(spans)
    dev = logits.device
    sub_logits = logits[torch.tensor(idx, device=dev)]
    p = sampler.probs(sub_logits, [rows[i] for i in idx])
    items: list[VerifyItem] = []
    at = 0
    for s in spans:
        draft = s.chunk.spec_token_ids
        prop = proposals.get(s.chunk.request_id)
        q = prop.draft_probs if prop is not None and prop.token_ids == draft else None
        items.append(VerifyItem(draft, rows[s.offset:s.offset + len(draft) + 1], at, q))
        at += s.chunk.num_samples
    emitted = rejection_sample(p, items, sampler)
    lp_rows = [it.offset + j for it, toks in zip(items, emitted, strict=True)
               for j in range(len(toks))]
    flat = [t for toks in emitted for t in toks]
    lps = raw_logprobs(sub_logits[torch.tensor(lp_rows, device=dev)],
                       [rows[idx[r]] for r in lp_rows], flat)
    at = 0
    for s, toks in zip(spans, emitted, strict=True):
        rid = s.chunk.request_id
        result.sampled[rid] = toks
        result.logprobs[rid] = lps[at:at + len(toks)]
        at += len(toks)
        result.outcomes.append(Outcome(rid, len(s.chunk.spec_token_ids), len(toks) - 1))
