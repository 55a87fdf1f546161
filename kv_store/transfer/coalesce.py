"""How many ready LAYER parts one message carries: the coalescing policy of a pair's sender.

Layers are streamed one by one as prefill computes them, and each message costs a round of
thread and process wake-ups on both ends (the header, and over NIXL the write) whatever its
size. When several parts are ready at once (the end of a prefill chunk, a
pull, a backlog behind a slow receiver) they go in one message (wire `BATCH`); a part that is
alone goes alone at once, so streaming is never held back to fill a batch.

Over NIXL the window is the landing slots the receiver granted the pair: a message takes at
most half of them, so the sender writes the next message while the receiver copies the last
one out (a pipeline two deep), and it writes only into slots the receiver has counted as
copied out (a slow receiver holds the sender back: backpressure, nothing is overwritten).
"""

from __future__ import annotations


def parts_per_message(ready: int, cap: int, window: int | None = None) -> int:
    """Parts to put in the next message.

    `ready`: parts waiting, in order; `cap`: `TransferConfig.coalesce_max_parts`; `window`:
    the landing slots the receiver granted the pair (None: inline payloads, no window).
    Over NIXL the sender waits until that many slots are free: when it is ahead of the
    receiver, waiting costs nothing (the receiver still has the other half to copy) and keeps
    messages large, where taking each slot as it comes back would settle into one part per
    message. A lone ready part still goes at once, in the first slot that is free."""
    if ready <= 0 or cap <= 0:
        return 0
    n = min(ready, cap)
    return n if window is None else min(n, max(1, window // 2))
