"""Choosing workers: pure functions over load figures, no I/O (tested without processes).

Load of a decode worker: KV blocks in use plus a per-request share for requests this router has
in flight there (stats lag by up to one poll). Load of a prefill worker: prompt tokens queued
plus the tokens this router has sent it and not yet seen answered.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Load:
    index: int
    queued_tokens: int
    used_blocks: int
    total_blocks: int
    inflight: int


def pick_decode(loads: Sequence[Load], blocks_per_request: int = 8) -> int | None:
    """Least loaded decode worker by KV usage (fraction of its cache), ties by index."""
    if not loads:
        return None

    def cost(ld: Load) -> float:
        used = ld.used_blocks + ld.inflight * blocks_per_request
        return used / max(ld.total_blocks, 1)

    return min(loads, key=lambda ld: (cost(ld), ld.inflight, ld.index)).index


def pick_prefill(loads: Sequence[Load], prompt_tokens: int) -> int | None:
    """Prefill worker with the least queued work (tokens), ties by index."""
    if not loads:
        return None
    return min(loads, key=lambda ld: (ld.queued_tokens + ld.inflight * prompt_tokens,
                                      ld.index)).index


def prefill_remotely(prompt_tokens: int, cached_tokens: int, threshold: int,
                     have_prefill_workers: bool) -> bool:
    """Conditional disaggregation: short uncached work is cheaper to prefill on D itself."""
    return have_prefill_workers and prompt_tokens - cached_tokens > threshold
