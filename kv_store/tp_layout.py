"""How KV heads are laid out over tensor-parallel ranks, shared by senders and receivers.

KV heads are split evenly over the ranks of a group; when there are fewer heads than ranks,
each head is replicated on the ranks whose query heads use it (see
`pdserve.engine.layers.linear.kv_head_start`). Between groups of different degrees, each
sending rank sends every receiving rank the overlap of their heads, and a replicated head is
sent once, by the lowest rank holding it.

The transfer engine keys a request's transfer by its id, on the sender and on the receiver;
when parts of one request travel between several (prefill rank, decode rank) pairs, each pair
uses its own wire id (`wire_request_id`), which the receiver maps back (`base_request_id`).
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.engine.layers.linear import kv_head_start

_RANK_SEP = "@tp"  # never in a request id: the router only accepts [A-Za-z0-9._:-]


def heads_of(num_kv_heads: int, rank: int, size: int) -> range:
    """Global KV heads held by `rank` of a group of `size` (split, or replicated if scarce)."""
    start = kv_head_start(num_kv_heads, rank, size)
    return range(start, start + max(1, num_kv_heads // size))


def owned_heads(num_kv_heads: int, rank: int, size: int) -> range:
    """Heads this rank sends: those no lower rank also holds (replicas send once)."""
    mine = heads_of(num_kv_heads, rank, size)
    if rank and mine.start in heads_of(num_kv_heads, rank - 1, size):
        return range(0)
    return mine


def head_routes(num_kv_heads: int, sender_rank: int, sender_size: int,
                receivers: Sequence[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """(address, first head, end head) of what `sender_rank` sends each receiver
    `(address, rank, size)` that shares heads with it: the overlap of the heads it owns
    (`owned_heads`) with the receiver's heads (global indices)."""
    mine = owned_heads(num_kv_heads, sender_rank, sender_size)
    out = []
    for address, rank, size in receivers:
        theirs = heads_of(num_kv_heads, rank, size)
        lo, hi = max(mine.start, theirs.start), min(mine.stop, theirs.stop)
        if lo < hi:
            out.append((address, lo, hi))
    return out


def wire_request_id(request_id: str, sender_rank: int, receiver_rank: int) -> str:
    if sender_rank == 0 and receiver_rank == 0:
        return request_id
    return f"{request_id}{_RANK_SEP}{sender_rank}.{receiver_rank}"


def base_request_id(wire_id: str) -> str:
    return wire_id.split(_RANK_SEP, 1)[0]
