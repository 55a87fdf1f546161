"""How many ready LAYER parts one message carries: the coalescing policy of a pair's sender.

Layers are streamed one by one as prefill computes them, and each message costs a round of
thread and process wake-ups on both ends (the header, and over NIXL the write and the GRANT
back) whatever its size. When several parts are ready at once (the end of a prefill chunk, a
pull, a backlog behind a slow receiver) they go in one message (wire `BATCH`); a part that is
alone goes alone at once, so streaming is never held back to fill a batch.

Over NIXL the window is the landing slots the receiver granted the pair: a message takes at
most half of them, so the sender writes the next message while the receiver copies the last
one out (a pipeline two deep), and never more than are free (a slow receiver holds the sender
back: backpressure, nothing is overwritten).
"""

from __future__ import annotations


def parts_per_message(ready: int, cap: int, free_slots: int | None = None,
                      owned_slots: int = 0) -> int:
    """Parts to put in the next message.

    `ready`: parts waiting, in order; `cap`: `TransferConfig.coalesce_max_parts`;
    `free_slots` / `owned_slots`: the NIXL window (None: inline payloads, no window).
    0 only when nothing is ready or no slot is free (the caller waits for a GRANT)."""
    if ready <= 0 or cap <= 0:
        return 0
    n = min(ready, cap)
    if free_slots is None:
        return n
    return min(n, free_slots, max(1, owned_slots // 2))
