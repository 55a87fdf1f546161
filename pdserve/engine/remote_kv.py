"""Requests whose KV arrives from another worker: the engine's half of a KV hand-off.

Two kinds, both owned by the scheduler while they wait (`Scheduler.reserve_remote`,
`Scheduler.reserve_pull`); a worker drives them through `LLMEngine`'s remote-KV methods only.

    remote prefill (a prefill worker computes the prompt and sends its KV):
        reserve_remote ─► WAITING_FOR_KV ──activate(first token)──► RUNNING
                             │                               └──► FINISHED_* (a stop rule)
                             └──fail / abort──► FINISHED_ABORTED
    pull (a prefix another worker holds is copied here, the rest is computed here):
        reserve_pull ─► PULLING ──settle(k blocks landed)──► WAITING ─► RUNNING (prefill)
                           └──abort──► FINISHED_ABORTED

While it waits a request holds its blocks, so nothing else can write them: a remote prefill
holds its whole prompt (the leading `cached_blocks` already here, from the prefix cache); a
pull holds its own leading blocks [0, start) pinned and fresh blocks for [start, end). After a
pull settles, the k landed blocks are published under their hashes and the rest are freed;
the request keeps its blocks until its admission takes its own prefix hit over them.

How much of the KV has landed is the transport side's business: a `KVArrival` tracks the
(layer, block, KV head) parts of one reservation, updated under the receiver's lock on its
threads; the scheduler only learns the outcome (activate, settle, fail), on the engine thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class NoKVCapacity(Exception):
    """Not enough free KV blocks to reserve the request's prompt."""


@dataclass(frozen=True)
class KVReservation:
    """Blocks reserved for a remotely prefilled request (its whole prompt)."""

    request_id: str
    block_ids: tuple[int, ...]
    """Every prompt block, in prompt order (the sender's destination table)."""
    cached_blocks: int
    """Leading blocks this engine already holds (its own prefix cache): never sent."""

    @property
    def needed(self) -> tuple[int, ...]:
        """The blocks whose KV must still arrive."""
        return self.block_ids[self.cached_blocks:]


@dataclass(frozen=True)
class PullReservation:
    """Blocks reserved for a pull of prompt blocks [start_block, end_block)."""

    request_id: str
    token_ids: tuple[int, ...]
    """Every token of the request (prompt, then any earlier output): what the source hashes."""
    start_block: int
    """Leading blocks [0, start_block) are already here (pinned until the request runs)."""
    block_ids: tuple[int, ...]
    """Destination of each block of [start_block, end_block), in order."""

    @property
    def end_block(self) -> int:
        return self.start_block + len(self.block_ids)


class KVOutOfBounds(ValueError):
    """KV offered for a block, layer or head that the reservation does not expect."""


class KVArrival:
    """The (layer, block index, KV head) parts of a reservation still missing on one rank.

    Pure and not thread-safe: its owner (the receive side) serialises calls. `expected` are
    the destination blocks, in order; `skip` leading ones are not expected at all."""

    def __init__(self, block_ids: Sequence[int], skip: int, num_layers: int,
                 heads: range) -> None:
        self.block_ids = tuple(block_ids)
        self.skip = skip
        self.num_layers = num_layers
        self.heads = heads
        self._index = {b: i for i, b in enumerate(self.block_ids) if i >= skip}
        self._missing = {(layer, i, h) for layer in range(num_layers)
                         for i in range(skip, len(self.block_ids)) for h in heads}

    @property
    def complete(self) -> bool:
        return not self._missing

    @property
    def num_missing(self) -> int:
        return len(self._missing)

    def check(self, layer: int, block_ids: Sequence[int], head_start: int,
              num_heads: int) -> None:
        """Raise `KVOutOfBounds` unless every part offered is one this reservation expects."""
        if not 0 <= layer < self.num_layers:
            raise KVOutOfBounds(f"layer {layer} outside [0, {self.num_layers})")
        if head_start < self.heads.start or head_start + num_heads > self.heads.stop:
            raise KVOutOfBounds(f"KV heads [{head_start}, {head_start + num_heads}) outside "
                                f"this rank's [{self.heads.start}, {self.heads.stop})")
        stray = [b for b in block_ids if b not in self._index]
        if stray:
            raise KVOutOfBounds(f"blocks {stray[:4]} are not in the reservation")

    def record(self, layer: int, block_ids: Sequence[int], head_start: int,
               num_heads: int) -> None:
        """Mark parts as landed (after `check`; the caller wrote them)."""
        heads = range(head_start, head_start + num_heads)
        self._missing.difference_update((layer, self._index[b], h) for b in block_ids
                                        for h in heads)

    def limit(self, num_blocks: int) -> None:
        """Only the first `num_blocks` expected blocks will come (a pull's source held no
        more): stop waiting for parts of the others."""
        end = self.skip + max(num_blocks, 0)
        self._missing = {part for part in self._missing if part[1] < end}
