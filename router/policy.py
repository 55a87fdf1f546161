"""Choosing workers: pure functions over load and cache figures, no I/O.

Decode: the least loaded worker by KV usage (blocks used + an allowance per request this router
has in flight there, over capacity), except that among workers within `max_imbalance` of the
least loaded, the one already holding the longest prefix of the prompt wins (multi-turn
conversations return to the worker that has their earlier turns).

Prefill: the least work, in tokens: the prompt tokens still to compute after the worker's
cached prefix, plus the tokens queued there. Workers whose queue is more than
`max_imbalance_tokens` above the shortest queue are not considered, so a popular prefix never
piles every request onto one worker.

`cached_blocks` are tier-weighted: a block in a slower tier counts for less than one in device
memory, by what loading it saves over recomputing it — `1 - (block bytes / tier bandwidth) /
(block tokens / prefill speed)` from the worker's KV layout (`WorkerInfo.kv_bytes_per_block`)
and its measured speeds (`tier_weights`); `TIER_WEIGHTS` until a speed is measured. So a
latent (MLA) block, a fraction of a GQA block's bytes, is worth nearly as much on SSD as on
the device.

Pull: when another worker holds a longer leading prefix than the chosen decode worker and the
rest of the prompt is short enough for the decode worker to compute, it pulls that prefix
(`pick_pull_source`). Prefetch: a chosen worker whose match runs into its host/SSD tiers is
told which blocks to warm up (`prefetch_hashes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Worth of a cached block by tier (device, host, SSD), relative to not recomputing it at all,
# while the worker's speeds are not measured yet.
TIER_WEIGHTS = (1.0, 0.7, 0.4)


@dataclass(frozen=True)
class TierSpeeds:
    """What a worker's cached block below device memory is worth: its block's real size and
    the speeds it measured (0 = not measured yet)."""

    block_bytes: int  # one KV block, every layer, as one rank's tiers hold it
    block_tokens: int
    host_bw: float = 0.0  # bytes/s
    ssd_bw: float = 0.0
    prefill_tps: float = 0.0  # tokens/s


def tier_weights(speeds: TierSpeeds | None) -> tuple[float, float, float]:
    """(device, host, SSD) worth of a cached block: the share of its recompute time that
    loading it saves, `TIER_WEIGHTS` for a tier whose speed is unknown."""
    weights = list(TIER_WEIGHTS)
    if speeds is None or speeds.block_bytes <= 0 or speeds.prefill_tps <= 0:
        return TIER_WEIGHTS
    recompute_s = speeds.block_tokens / speeds.prefill_tps
    for i, bw in ((1, speeds.host_bw), (2, speeds.ssd_bw)):
        if bw > 0:
            weights[i] = max(0.0, 1.0 - speeds.block_bytes / bw / recompute_s)
    return weights[0], weights[1], weights[2]


@dataclass(frozen=True)
class Load:
    index: int
    queued_tokens: int
    used_blocks: int
    total_blocks: int
    inflight: int
    cached_blocks: float = 0.0  # leading prompt blocks held (tier-weighted)


def _usage(ld: Load, blocks_per_request: int) -> float:
    return (ld.used_blocks + ld.inflight * blocks_per_request) / max(ld.total_blocks, 1)


def pick_decode(loads: Sequence[Load], blocks_per_request: int = 8,
                max_imbalance: float = 0.25) -> int | None:
    if not loads:
        return None
    floor = min(_usage(ld, blocks_per_request) for ld in loads)
    eligible = [ld for ld in loads if _usage(ld, blocks_per_request) <= floor + max_imbalance]
    return min(eligible, key=lambda ld: (-ld.cached_blocks, _usage(ld, blocks_per_request),
                                         ld.inflight, ld.index)).index


def pick_prefill(loads: Sequence[Load], prompt_tokens: int, block_size: int = 16,
                 max_imbalance_tokens: int = 4096) -> int | None:
    if not loads:
        return None

    def uncached(ld: Load) -> float:
        return max(prompt_tokens - ld.cached_blocks * block_size, 1.0)

    def queue(ld: Load) -> float:
        # Requests sent there and not yet answered, assumed to need what this one needs there
        # (requests that share a prefix tend to go to the same worker).
        return ld.queued_tokens + ld.inflight * uncached(ld)

    def work(ld: Load) -> float:
        return uncached(ld) + queue(ld)

    floor = min(queue(ld) for ld in loads)
    eligible = [ld for ld in loads if queue(ld) <= floor + max_imbalance_tokens]
    return min(eligible, key=lambda ld: (work(ld), ld.index)).index


def weighted_blocks(leading_by_tier: Sequence[int],
                    weights: Sequence[float] = TIER_WEIGHTS) -> float:
    """Tier-weighted count of leading blocks from `PrefixMatch.leading`-style cumulative
    counts (blocks in tier t or faster)."""
    total, prev = 0.0, 0
    for weight, upto in zip(weights, leading_by_tier, strict=False):
        total += weight * (upto - prev)
        prev = upto
    return total


def prefill_remotely(prompt_tokens: int, cached_tokens: int, threshold: int,
                     have_prefill_workers: bool) -> bool:
    """Conditional disaggregation: short uncached work is cheaper to prefill on D itself."""
    return have_prefill_workers and prompt_tokens - cached_tokens > threshold


@dataclass(frozen=True)
class Holder:
    """A worker other than the chosen decode worker, as a possible source of a pull."""

    index: int
    blocks: int  # leading prompt blocks it holds, any tier (PrefixMatch.blocks)
    device_blocks: int  # of which in device memory (PrefixMatch.leading[0])
    tp_size: int


def pick_pull_source(holders: Sequence[Holder], own_blocks: int, prompt_tokens: int,
                     block_size: int, threshold: int, have_prefill_workers: bool,
                     min_gain_blocks: int = 1) -> Holder | None:
    """The worker the decode worker should pull the prompt's prefix from, or None.

    Worth it only when the decode worker computes the rest itself (at most `threshold`
    tokens, unless there is no prefill worker at all): a prefill worker without the prefix
    would recompute it anyway. Pullable blocks stop one token short of the prompt's end (the
    last token is always computed). The longest prefix wins, then the most in device memory.
    Only single-rank sources for now (tp_size 1)."""
    limit = max(prompt_tokens - 1, 0) // block_size
    best: Holder | None = None
    for h in holders:
        blocks = min(h.blocks, limit)
        if h.tp_size != 1 or blocks < own_blocks + min_gain_blocks:
            continue
        if have_prefill_workers and prompt_tokens - blocks * block_size > threshold:
            continue
        if best is None or (blocks, h.device_blocks) > (min(best.blocks, limit),
                                                          best.device_blocks):
            best = h
    return best


def prefetch_hashes(leading_by_tier: Sequence[int], hashes: Sequence[bytes]) -> list[bytes]:
    """Hashes of a worker's matched blocks that sit below device memory (host or SSD):
    what a prefetch hint names. Empty when the whole match is in device memory."""
    if not leading_by_tier:
        return []
    return list(hashes[leading_by_tier[0]:leading_by_tier[-1]])
