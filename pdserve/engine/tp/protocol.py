"""Messages from rank 0 to the follower ranks: msgpack, versioned, broadcast as bytes.

    {"v": VERSION, "op": "setup", "num_blocks": int}
    {"v": VERSION, "op": "step", "chunks": [[token_ids, start, block_ids, num_samples,
                                             num_prompt_logits], ...],
                               "extra": {...}}   # e.g. the prefill worker's KV sends
    {"v": VERSION, "op": "copy_blocks", "pairs": [[src, dst], ...]}   # a fork's copy-on-write
    {"v": VERSION, "op": "stop"}
    {"v": VERSION, "op": "tier", "call": TierOp wire | absent}   # see pdserve.engine.tp.tiers
    any message may carry "tier_ops": [TierOp wire, ...], run by followers before the message
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from pdserve.engine.scheduler import ScheduledChunk

# History: 1 - setup / step / stop. 2 - "tier" calls and "tier_ops" on any message.
# 3 - a step's chunks carry num_prompt_logits (prompt logprobs: the LM head gathers those
# rows on every rank); "copy_blocks" (a fork's copy of its parent's last partial block).
VERSION = 3


def encode_chunks(chunks: Sequence[ScheduledChunk]) -> list[list[Any]]:
    return [[c.token_ids, c.start, c.block_ids, c.num_samples, c.num_prompt_logits]
            for c in chunks]


def decode_chunks(rows: list[list[Any]]) -> list[ScheduledChunk]:
    return [ScheduledChunk("", list(t), int(s), list(b), int(n), num_prompt_logits=int(p))
            for t, s, b, n, p in rows]


def broadcast_message(group: dist.ProcessGroup, message: dict | None, rank: int) -> dict:
    """Rank 0 passes `message`; every rank returns it. Two broadcasts: length, then bytes."""
    if rank == 0:
        assert message is not None
        payload = msgpack.packb({"v": VERSION, **message}, use_bin_type=True)
        size = torch.tensor([len(payload)], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    group.broadcast(size, 0).wait()
    if rank == 0:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    else:
        data = torch.empty(int(size.item()), dtype=torch.uint8)
    group.broadcast(data, 0).wait()
    if rank == 0:
        return {"v": VERSION, **message}
    decoded = msgpack.unpackb(data.numpy().tobytes(), raw=False)
    if decoded.get("v") != VERSION:
        raise RuntimeError(f"tp message version {decoded.get('v')} != {VERSION}")
    return decoded
