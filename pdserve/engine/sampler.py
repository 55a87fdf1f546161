"""Turns one step's logits into tokens: penalties, masks, truncation, the seeded draw, logprobs.

This module owns the sampling math of the engine and nothing else: the engine hands it the
logits of every row that needs a token plus what each row has seen (`SamplingRow`), and gets
the tokens and logprobs back (`SamplerOutput`). It keeps no state between calls.

Processing order (vLLM's), all in fp32 whatever the logits' dtype:

    grammar bitmask (structured outputs: `apply_token_bitmask`, by the engine, in place)
        ▼
    raw logits ──► logprobs (log_softmax of the raw logits, if asked)
        │
        ▼ allowed_token_ids (every other token -inf), bad words (a sequence's last token -inf
          when the output ends with the rest)
        ▼ repetition penalty (prompt + output tokens), presence / frequency (output tokens)
        ▼ logit_bias (added)
        ▼ min_tokens: stop_token_ids (and EOS unless ignore_eos) banned while step < min_tokens
          (never on a row where they are the only tokens left, e.g. a grammar's end)
        ├──► greedy rows: argmax (ties ⇒ lowest id)
        ▼ temperature ▸ top-k ▸ top-p ▸ min-p ▸ softmax
        ▼ seeded inverse-CDF draw

Determinism: a row's draw depends only on (seed, step) and its own distribution, never on the
batch, the row's position in it, or global RNG state. Each row's one uniform u in [0, 1) comes
from a CPU `torch.Generator` seeded with `derive_seed(seed, step)` (blake2b, stable across
processes and machines); the token is the first whose running probability mass exceeds
u * total (accumulated in fp64). One uniform per row, rather than one exponential per
vocabulary entry as in the exponential race, keeps the CPU generator cheap and the
host-to-device copy tiny when logits are on a GPU, while CPU and GPU see the same numbers.

Top-k and top-p keep every token tied with the last one kept: the masks compare values against
a cutoff value, so they never depend on how a sort orders equal logits.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.sampling_params import SamplingParams

_SEED_BYTES = 8
_SEED_MASK = 2**63 - 1
_SEED_PERSON = b"pdserve.sampler"  # blake2b personalisation: domain-separates our seeds
_TOP_P_CANDIDATES = 1024
_DRAW_BLOCK = 256
_CHOICE_STREAM = 2**32  # far from the per-step streams speculative decoding uses


@dataclass(frozen=True)
class SamplingRow:
    """What the sampler needs to know about one row of the logits."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    """Prompt tokens, for the repetition penalty (a list or a 1-D integer tensor)."""
    output_token_ids: Sequence[int]
    """Tokens generated so far, for the penalties."""
    seed: int
    """Always set: the engine draws one for unseeded requests. In [0, 2**64)."""
    step: int
    """Index of the token being sampled (len(output_token_ids) outside speculative decoding)."""
    eos_token_ids: frozenset[int] = frozenset()
    """Banned, with params.stop_token_ids, while step < params.min_tokens (unless ignore_eos)."""

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {type(self.seed).__name__}")
        if not 0 <= self.seed < 2 ** (8 * _SEED_BYTES):
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise ValueError(f"step must be an int >= 0, got {self.step!r}")


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities (of the raw logits) for one sampled token."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    """Top-n (token_id, logprob), descending; empty when the row asked for n == 0."""
    rank: int | None = None
    """Prompt scoring: 1 + how many tokens were more likely (None for sampled tokens)."""


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    """One token per row, in row order."""
    logprobs: list[TokenLogprobs | None]
    """Per row; None where the row did not ask for logprobs."""


@torch.inference_mode()
def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]
                        ) -> None:
    """Mask (-inf, in place) the logits a grammar forbids: row rows[i] of `logits` keeps token
    t only if bit t % 32 of word t // 32 of bitmask[i] is set (xgrammar's int32 layout).

    Applied before sampling, logprobs and speculative verification alike, so a forbidden
    token is never sampled, never reported as likely, and a forbidden draft is rejected.
    """
    if not rows:
        return
    if logits.dtype not in _XGR_DTYPES:
        _apply_bitmask_torch(logits, bitmask, rows)
        return
    import xgrammar as xgr  # only constrained steps get here (the import is cached)

    vocab = logits.shape[1]
    covered = min(vocab, bitmask.shape[1] * 32)
    # xgrammar's own kernel (C++ on the CPU, Triton/CUDA on GPUs): unpacking the bits with
    # torch ops cost 10x more, ~20 ms a step at 4 rows of a 49k vocabulary.
    # xgrammar indexes logits and bitmask by the same row: spread ours onto the logits' rows.
    # (index_copy_, not `full[list] = ...`: that indexing alone cost ~17 ms here.)
    idx = torch.tensor(list(rows), dtype=torch.long)
    full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32)
    full.index_copy_(0, idx, bitmask.to(torch.int32).cpu())
    xgr.apply_token_bitmask_inplace(logits, full.to(logits.device), vocab_size=covered,
                                    indices=list(rows))
    if covered < vocab:  # ids past the grammar's vocabulary are never allowed
        logits[idx.to(logits.device), covered:] = float("-inf")


_XGR_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _apply_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]
                         ) -> None:
    """`apply_token_bitmask` in torch ops, for the dtypes xgrammar's kernel does not take."""
    dev = logits.device
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=dev)
    allowed = ((bitmask.to(dev).unsqueeze(-1) >> shifts) & 1).reshape(len(rows), -1).bool()
    if allowed.shape[1] < vocab:  # ids past the grammar's vocabulary are never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    idx = torch.tensor(list(rows), device=dev)
    logits[idx] = logits[idx].masked_fill(~allowed[:, :vocab], float("-inf"))


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request with several outputs (`n`): choice 0 keeps the
    request's seed, so n=1 is unchanged; the others get independent, reproducible seeds."""
    if index == 0:
        return seed
    return derive_seed(seed, index, _CHOICE_STREAM) & _SEED_MASK


def derive_seed(seed: int, step: int, stream: int = 0) -> int:
    """63-bit generator seed for one draw: a stable hash of (seed, step, stream).

    `stream` separates independent draws made for the same step (speculative decoding's
    resampling, for instance); the ordinary draw uses stream 0.
    """
    for name, value in (("seed", seed), ("step", step), ("stream", stream)):
        if not 0 <= value < 2 ** (8 * _SEED_BYTES):
            raise ValueError(f"{name} must be in [0, 2**64), got {value}")
    data = b"".join(v.to_bytes(_SEED_BYTES, "little") for v in (seed, step, stream))
    digest = hashlib.blake2b(data, digest_size=8, person=_SEED_PERSON).digest()
    return int.from_bytes(digest, "little") & _SEED_MASK


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, the lowest id on ties (a NaN wins, as in `argmax`). `max(dim)`
    gives the same index: on the CPU its kernel is vectorised where argmax's is not (0.43
    against 1.1 ms for 32 rows of a 49k vocabulary, 2 threads)."""
    return logits.max(dim=-1).indices


class Sampler:
    """Stateless: every call takes the logits [N, V] and N rows, in the same order."""

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """Sample one token per row, with logprobs where asked."""
        _check_batch(logits, rows)
        if all(_is_plain_greedy(r) for r in rows):
            token_ids = greedy_tokens(logits).tolist()  # fast path: nothing to process
        else:
            token_ids = self._sample(logits, rows)
        return SamplerOutput(token_ids=token_ids, logprobs=_logprobs(logits, rows, token_ids))

    def probs(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """[N, V] fp32 final sampling distribution of each row.

        Greedy rows get the softmax of their penalised, masked logits (no temperature, no
        truncation): their token is the argmax of that, not a draw from it.
        """
        _check_batch(logits, rows)
        processed = _processed_logits(logits, rows)
        out = torch.softmax(processed, dim=-1)
        sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        if sampled:
            idx = torch.tensor(sampled, device=logits.device)
            out[idx] = _truncated_probs(processed[idx], [rows[i].params for i in sampled])
        return out

    def sample_from_probs(
        self, probs: torch.Tensor, rows: Sequence[SamplingRow], *, stream: int = 0
    ) -> list[int]:
        """The seeded draw alone, from non-negative (not necessarily normalised) probs [N, V]."""
        _check_batch(probs, rows)
        return _draw(probs, rows, stream).tolist() if rows else []

    def _sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
        processed = _processed_logits(logits, rows)
        # Right for every greedy row; sampled rows are overwritten below.
        token_ids = greedy_tokens(processed)
        sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        if sampled:
            idx = torch.tensor(sampled, device=logits.device)
            sub_rows = [rows[i] for i in sampled]
            probs = _truncated_probs(processed[idx], [r.params for r in sub_rows])
            token_ids[idx] = _draw(probs, sub_rows, stream=0)
        return token_ids.tolist()


# -- checks and row classification -----------------------------------------------------------


def _check_batch(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    if logits.dim() != 2 or logits.shape[1] < 1:
        raise ValueError(f"logits must be [N, V] with V >= 1, got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a float tensor, got {logits.dtype}")
    if logits.shape[0] != len(rows):
        raise ValueError(f"rows has {len(rows)} entries but logits has {logits.shape[0]} rows")


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _min_tokens_active(row: SamplingRow) -> bool:
    return row.step < row.params.min_tokens


def _is_plain_greedy(row: SamplingRow) -> bool:
    p = row.params
    return (p.is_greedy and not _has_penalty(p) and not _min_tokens_active(row)
            and not p.logit_bias and not p.allowed_token_ids and not p.bad_words_token_ids)


# -- logits processing: penalties and min_tokens ---------------------------------------------


def _processed_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """fp32 copy of the logits with penalties and min_tokens bans applied (input untouched)."""
    x = logits.to(dtype=torch.float32, copy=True)
    _apply_token_masks(x, rows)
    _apply_penalties(x, rows)
    _apply_logit_bias(x, rows)
    _apply_min_tokens(x, rows)
    return x


def _apply_token_masks(x: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """allowed_token_ids and bad words, in place: the tokens a row may not sample get -inf."""
    vocab = x.shape[1]
    for i, r in enumerate(rows):
        allowed = [t for t in r.params.allowed_token_ids if t < vocab]
        if allowed:
            keep = torch.full((vocab,), float("-inf"), dtype=x.dtype, device=x.device)
            keep[torch.tensor(allowed, device=x.device)] = 0.0
            x[i] += keep
        banned = _banned_words(r)
        if banned:
            x[i, torch.tensor(banned, device=x.device)] = float("-inf")


def _banned_words(row: SamplingRow) -> list[int]:
    """Last tokens of the bad-word sequences whose other tokens end the output so far."""
    seqs = row.params.bad_words_token_ids
    if not seqs:
        return []
    out = [int(t) for t in row.output_token_ids[-max(len(s) for s in seqs):]]
    return [s[-1] for s in seqs
            if len(s) == 1 or (len(out) >= len(s) - 1 and out[len(out) - len(s) + 1:] ==
                               list(s[:-1]))]


def _apply_logit_bias(x: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    row_of: list[int] = []
    token: list[int] = []
    bias: list[float] = []
    vocab = x.shape[1]
    for i, r in enumerate(rows):
        for tid, b in r.params.logit_bias:
            if tid < vocab:
                row_of.append(i)
                token.append(tid)
                bias.append(b)
    if row_of:
        at = (torch.tensor(row_of, device=x.device), torch.tensor(token, device=x.device))
        x.index_put_(at, torch.tensor(bias, dtype=x.dtype, device=x.device), accumulate=True)


def _apply_penalties(x: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Penalise, in place, only the (row, token) positions that occurred: O(tokens), not O(N*V)."""
    rep_rows = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if rep_rows:
        at = _positions(x, rep_rows, [(rows[i].prompt_token_ids, rows[i].output_token_ids)
                                      for i in rep_rows])
        rep = _per_row(rows, "repetition_penalty", x.device)[at[0]]
        seen = x[at]  # duplicates gather and write back the same value
        # Pushes seen tokens towards "less likely" whatever the logit's sign.
        x[at] = torch.where(seen > 0, seen / rep, seen * rep)
    out_rows = [i for i, r in enumerate(rows)
                if r.params.presence_penalty != 0.0 or r.params.frequency_penalty != 0.0]
    if out_rows:
        row_of, token = _positions(x, out_rows, [(rows[i].output_token_ids,) for i in out_rows])
        key, count = torch.unique(row_of * x.shape[1] + token, return_counts=True)
        row_of, token = key // x.shape[1], key % x.shape[1]
        freq = _per_row(rows, "frequency_penalty", x.device)[row_of]
        pres = _per_row(rows, "presence_penalty", x.device)[row_of]
        x.index_put_((row_of, token), -(freq * count + pres), accumulate=True)


def _positions(
    x: torch.Tensor, row_ids: list[int], token_lists: list[tuple[Sequence[int], ...]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) index tensors on x's device for every token of every listed row."""
    parts = [[torch.as_tensor(t, dtype=torch.long).reshape(-1).cpu() for t in lists]
             for lists in token_lists]
    tokens = [torch.cat(p) for p in parts]
    flat = torch.cat(tokens)
    vocab = x.shape[1]
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= vocab):
        bad = flat[(flat < 0) | (flat >= vocab)][0]
        raise ValueError(f"token ids must be in [0, {vocab}), got {int(bad)}")
    lengths = torch.tensor([t.numel() for t in tokens])
    row_of = torch.repeat_interleave(torch.tensor(row_ids), lengths)
    return row_of.to(x.device), flat.to(x.device)


def _per_row(rows: Sequence[SamplingRow], name: str, dev: torch.device) -> torch.Tensor:
    """[N] fp32 tensor of one float field of every row's params."""
    values = [getattr(r.params, name) for r in rows]
    return torch.tensor(values, dtype=torch.float32, device=dev)


def _apply_min_tokens(x: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    vocab = x.shape[1]
    row_of: list[int] = []
    banned: list[int] = []
    for i, r in enumerate(rows):
        if not _min_tokens_active(r):
            continue
        stops = set(r.params.stop_token_ids)
        if not r.params.ignore_eos:  # with ignore_eos, EOS does not end the request: allow it
            stops |= r.eos_token_ids
        # Ids past the logits' width cannot be sampled anyway.
        ids = [t for t in sorted(stops) if 0 <= t < vocab]
        row_of.extend([i] * len(ids))
        banned.extend(ids)
    if banned:
        at = (torch.tensor(row_of, device=x.device), torch.tensor(banned, device=x.device))
        before = x[at]
        x.index_put_(at, torch.tensor(float("-inf"), device=x.device))
        # A row with nothing left (a grammar that allows only its end) keeps its stop tokens.
        emptied = torch.isinf(x[at[0]].max(dim=-1).values)
        if bool(emptied.any()):
            keep = emptied.nonzero().flatten()
            x[at[0][keep], at[1][keep]] = before[keep]


# -- temperature and truncation --------------------------------------------------------------


def _truncated_probs(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Softmax after temperature, top-k, top-p and min-p, for rows that are not greedy."""
    x = x / _column(params, "temperature", x.device)
    vocab = x.shape[1]
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    ps = [p.top_p for p in params]
    _mask_top_k_top_p(x, ks, ps)
    if any(p.min_p > 0.0 for p in params):
        # prob < min_p * max_prob  <=>  logit < max_logit + log(min_p); log(0) = -inf keeps all.
        floor = x.max(dim=-1, keepdim=True).values + torch.log(_column(params, "min_p", x.device))
        x.masked_fill_(x < floor, float("-inf"))
    return torch.softmax(x, dim=-1)


def _mask_top_k_top_p(x: torch.Tensor, ks: list[int], ps: list[float]) -> None:
    """Mask (in place) the logits that top-k, then top-p, drop."""
    vocab = x.shape[1]
    need_k = [i for i, k in enumerate(ks) if k < vocab]
    if need_k:
        _mask_top_k(x, need_k, [ks[i] for i in need_k])
    need_p = [i for i, p in enumerate(ps) if p < 1.0]
    if need_p:
        _mask_top_p(x, need_p, [ps[i] for i in need_p])


def _mask_top_k(x: torch.Tensor, rows: list[int], ks: list[int]) -> None:
    idx = torch.tensor(rows, device=x.device)
    sub = x[idx]
    k = torch.tensor(ks, device=x.device)
    ranked = sub.topk(max(ks), dim=-1).values  # descending
    cutoff = ranked.gather(1, (k - 1).unsqueeze(1))
    x[idx] = sub.masked_fill(sub < cutoff, float("-inf"))


def _mask_top_p(x: torch.Tensor, rows: list[int], ps: list[float]) -> None:
    """Keep the best-ranked tokens until their mass reaches p (over what top-k left)."""
    dev = x.device
    idx = torch.tensor(rows, device=dev)
    sub = x[idx]
    p = torch.tensor(ps, dtype=torch.float32, device=dev)
    log_total = sub.logsumexp(dim=-1, keepdim=True)
    # A full sort of the vocabulary is slow; a peaked distribution reaches p within a few
    # hundred tokens, so try the best _TOP_P_CANDIDATES first and sort only rows that need more.
    n_cand = min(_TOP_P_CANDIDATES, sub.shape[1])
    ranked = sub.topk(n_cand, dim=-1).values
    keep = _top_p_keep(ranked, log_total, p)
    cutoff = ranked.gather(1, (keep - 1).unsqueeze(1))
    longer = (keep == n_cand) & (ranked[:, -1] > float("-inf")) & (n_cand < sub.shape[1])
    if bool(longer.any()):
        at = longer.nonzero().flatten()
        full = sub[at].sort(dim=-1, descending=True).values
        keep_full = _top_p_keep(full, log_total[at], p[at])
        cutoff[at] = full.gather(1, (keep_full - 1).unsqueeze(1))
    x[idx] = sub.masked_fill(sub < cutoff, float("-inf"))


def _top_p_keep(ranked: torch.Tensor, log_total: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """How many of the ranked (descending) logits top-p keeps, per row (>= 1)."""
    probs = torch.exp(ranked - log_total)
    # Mass of the strictly better-ranked tokens; a token is kept while that is still < p.
    running = torch.cumsum(probs, dim=-1)
    mass_before = torch.cat([torch.zeros_like(running[:, :1]), running[:, :-1]], dim=1)
    return (mass_before < p.unsqueeze(1)).sum(dim=-1)


def _column(params: Sequence[SamplingParams], name: str, dev: torch.device) -> torch.Tensor:
    """[n, 1] fp32 column of one float field, for broadcasting over the vocabulary."""
    values = [getattr(p, name) for p in params]
    return torch.tensor(values, dtype=torch.float32, device=dev).unsqueeze(1)


# -- the seeded draw -------------------------------------------------------------------------


def _uniforms(rows: Sequence[SamplingRow], stream: int) -> torch.Tensor:
    """[n] fp64 uniforms in [0, 1) on the CPU, one per row, each from a generator freshly
    seeded with derive_seed(seed, step, stream): nothing carries over from row to row."""
    out = torch.empty(len(rows), dtype=torch.float64)
    gen = torch.Generator(device="cpu")
    for i, r in enumerate(rows):
        gen.manual_seed(derive_seed(r.seed, r.step, stream))
        out[i] = torch.rand((), generator=gen, dtype=torch.float64)
    return out


def _draw(probs: torch.Tensor, rows: Sequence[SamplingRow], stream: int) -> torch.Tensor:
    """Inverse-CDF draw: the first token whose running mass exceeds u * total, per row.

    Two levels, so no [N, V] fp64 cumsum is materialised: pick the block of _DRAW_BLOCK tokens
    from the blocks' running mass, then the token from that block's running mass, both in fp64
    so tiny tokens keep their odds. A zero-mass token is never picked.
    """
    n, vocab = probs.shape
    pad = (-vocab) % _DRAW_BLOCK
    blocks = torch.nn.functional.pad(probs, (0, pad)) if pad else probs
    blocks = blocks.reshape(n, -1, _DRAW_BLOCK)
    block_mass = blocks.float().sum(dim=-1).double()  # 256-term fp32 sums are accurate enough
    _check_mass(probs, block_mass)
    block_cdf = block_mass.cumsum(dim=-1)
    target = _uniforms(rows, stream).to(probs.device) * block_cdf[:, -1]
    block = _first_above(block_cdf, target, block_mass)
    mass_before = torch.cat([torch.zeros_like(block_cdf[:, :1]), block_cdf[:, :-1]], dim=1)
    target = target - mass_before.gather(1, block.unsqueeze(1)).squeeze(1)
    inner = blocks[torch.arange(n, device=probs.device), block]
    token = _first_above(inner.cumsum(dim=-1, dtype=torch.float64), target, inner)
    return block * _DRAW_BLOCK + token


def _first_above(cdf: torch.Tensor, target: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Per row, the first i with cdf[i] > target; past the end (a rounding artefact), the
    last i with mass[i] > 0."""
    i = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)
    past = i >= cdf.shape[1]
    if bool(past.any()):
        i[past] = cdf.shape[1] - 1 - (mass[past] > 0).flip(-1).to(torch.int8).argmax(dim=-1)
    return i


def _check_mass(probs: torch.Tensor, block_mass: torch.Tensor) -> None:
    if bool(probs.min() < 0):
        raise ValueError("probs must be non-negative")
    total = block_mass.sum(dim=-1)
    bad = ~torch.isfinite(total) | (total <= 0)
    if bool(bad.any()):
        raise ValueError(f"probs rows {bad.nonzero().flatten().tolist()} have no finite mass")


# -- logprobs --------------------------------------------------------------------------------


_SCORE_ROWS = 256  # rows per log_softmax when scoring a prompt (bounds the fp32 temporaries)


def score_tokens(logits: torch.Tensor, token_ids: Sequence[int], top_n: int
                 ) -> list[TokenLogprobs]:
    """Logprobs (log_softmax of `logits` [n, V]) of the given tokens, one per row, each with
    the row's top `top_n` alternatives: how prompt tokens are scored (`prompt_logprobs`)."""
    out: list[TokenLogprobs] = []
    for lo in range(0, len(token_ids), _SCORE_ROWS):
        lp = torch.log_softmax(logits[lo:lo + _SCORE_ROWS].float(), dim=-1)
        ids = torch.tensor(list(token_ids[lo:lo + _SCORE_ROWS]), device=lp.device)
        chosen_t = lp.gather(1, ids.unsqueeze(1))
        ranks = ((lp > chosen_t).sum(dim=-1) + 1).tolist()
        chosen = chosen_t.squeeze(1).tolist()
        k = min(top_n, lp.shape[1])
        vals, tops = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
        for tid, c, v, t, r in zip(ids.tolist(), chosen, vals.tolist(), tops.tolist(), ranks,
                                   strict=True):
            out.append(TokenLogprobs(token_id=tid, logprob=c, top=tuple(zip(t, v, strict=True)),
                                     rank=r))
    return out


def _logprobs(
    logits: torch.Tensor, rows: Sequence[SamplingRow], token_ids: list[int]
) -> list[TokenLogprobs | None]:
    """log_softmax of the raw logits: the chosen token's logprob plus the row's top-n."""
    out: list[TokenLogprobs | None] = [None] * len(rows)
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if not want:
        return out
    dev = logits.device
    lp = torch.log_softmax(logits[torch.tensor(want, device=dev)].float(), dim=-1)
    chosen_ids = torch.tensor([token_ids[i] for i in want], device=dev)
    chosen = lp.gather(1, chosen_ids.unsqueeze(1)).squeeze(1).tolist()
    n_max = min(max(rows[i].params.logprobs for i in want), lp.shape[1])
    top_vals, top_ids = lp.topk(n_max, dim=-1) if n_max else (lp[:, :0], lp[:, :0].long())
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    for j, i in enumerate(want):
        n = min(rows[i].params.logprobs, n_max)
        top = tuple(zip(top_ids[j][:n], top_vals[j][:n], strict=True))
        out[i] = TokenLogprobs(token_id=token_ids[i], logprob=chosen[j], top=top)
    return out
