"""Which workers one attempt at a request uses, and the hints they get (no calls but hints).

    prompt blocks (hashes, what each worker holds: the KV index, a hint)
      ─► decode worker D (KV-aware `policy.pick_decode`, or round-robin)
      ─► a worker X to pull a prefix from (`policy.pick_pull_source`), or a prefill worker P
      ─► fire-and-forget `Prefetch` to each one chosen whose match runs into its host/SSD tiers

Only routable workers are chosen (healthy, not draining: `router.pool`). A moved request
(`router.migration`) avoids the workers that failed it, and its new decode worker pulls from
whoever holds more of it, however much is left to compute: the continuation is always
computed on D.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc

from kv_store.index.events import Tier
from kv_store.index.prefix import PrefixMatch
from pdserve.block_hash import chain_hashes
from pdserve.proto import worker_pb
from router import policy
from router.migration import prefer_others
from router.pool import WorkerHandle, WorkerPool

PREFETCH_TIMEOUT_S = 2.0  # a prefetch hint not taken by then is moot; never waited for


class NoWorker(Exception):
    """No healthy worker of the role that is needed (draining ones take nothing new)."""


@dataclass(frozen=True)
class PromptBlocks:
    """The request's block hashes and what each worker holds of them (KV index: a hint)."""

    hashes: list[bytes]
    matches: dict[str, PrefixMatch]

    def held_by(self, w: WorkerHandle) -> int:
        m = self.matches.get(w.address)
        return m.blocks if m is not None else 0


class Placement:
    def __init__(self, prefill: WorkerPool, decode: WorkerPool, local_prefill_tokens: int,
                 routing: str, counters: dict[str, float]) -> None:
        if routing not in ("kv", "round-robin"):
            raise ValueError(f"routing must be 'kv' or 'round-robin', got {routing!r}")
        self.prefill = prefill
        self.decode = decode
        self.local_prefill_tokens = local_prefill_tokens
        self.routing = routing
        self.counters = counters  # the flow's: prefetch hints sent / failed, pulls routed
        self._turn = {"prefill": 0, "decode": 0}  # round-robin cursors
        self.background: set[asyncio.Task] = set()  # prefetch hints in flight

    def block_size(self) -> int:
        info = next((w.info for w in self.decode.workers if w.info is not None), None)
        return info.block_size if info is not None and info.block_size else 16

    def blocks(self, token_ids: list[int]) -> PromptBlocks:
        """The tokens' hashes and the leading blocks each worker holds (KV index, a hint)."""
        info = next((w.info for w in self.decode.workers if w.info is not None), None)
        if info is None or not info.hash_extra:
            return PromptBlocks([], {})
        hashes = chain_hashes(token_ids, info.block_size, info.hash_extra)
        return PromptBlocks(hashes, self.decode.prefix.match(hashes) if hashes else {})

    def expect_blocks(self, worker: WorkerHandle, hashes: list[bytes]) -> None:
        """Record at once that `worker` is about to hold these blocks. The worker's own
        events confirm (or a snapshot corrects) this a poll later; without it, a burst of
        requests for a new prefix would be spread before the index learns where it went."""
        if self.routing == "kv" and hashes:
            self.decode.prefix.store(worker.address, hashes, Tier.DEVICE)

    def pull_source(self, rid: str, d: WorkerHandle, blocks: PromptBlocks, num_tokens: int,
                    continuation: bool = False) -> worker_pb.KVSource | None:
        """Where D should pull the request's prefix from (policy.pick_pull_source), if any.
        A continuation is computed on D whatever is left, so any prefix is worth offering:
        D pins what it really holds and pulls only beyond that (the index's idea of D may be
        stale: the attempt that just failed there was recorded as placed)."""
        others = [w for w in (*self.decode.routable(), *self.prefill.routable())
                  if w.address != d.address and w.address in blocks.matches]
        holders = [policy.Holder(i, blocks.matches[w.address].blocks,
                                 blocks.matches[w.address].leading[0],
                                 w.info.tp_size if w.info is not None else 0)
                   for i, w in enumerate(others)]
        have_prefill = bool(self.prefill.routable()) and not continuation
        own = 0 if continuation else blocks.held_by(d)
        h = policy.pick_pull_source(holders, own, num_tokens, self.block_size(),
                                    self.local_prefill_tokens, have_prefill)
        if h is None:
            return None
        self.counters["kv_pulls_routed"] += 1
        self.hint(rid, others[h.index], blocks)
        return worker_pb.KVSource(address=others[h.index].address, blocks=h.blocks)

    def hint(self, rid: str, w: WorkerHandle, blocks: PromptBlocks) -> None:
        """Fire-and-forget Prefetch of `w`'s matched blocks that sit in its host/SSD tiers."""
        m = blocks.matches.get(w.address)
        hashes = policy.prefetch_hashes(m.leading, blocks.hashes) if m is not None else []
        if not hashes:
            return
        self.counters["prefetch_hints"] += 1
        task = asyncio.create_task(self._prefetch(rid, w, hashes))
        self.background.add(task)  # a reference, so the task is not collected mid-flight
        task.add_done_callback(self.background.discard)

    async def _prefetch(self, rid: str, w: WorkerHandle, hashes: list[bytes]) -> None:
        try:
            await w.stub.Prefetch(worker_pb.PrefetchRequest(request_id=rid, block_hashes=hashes),
                                  timeout=PREFETCH_TIMEOUT_S)
        except grpc.aio.AioRpcError:  # only a hint: the request goes on without it
            self.counters["prefetch_hint_failures"] += 1

    def pick_decode(self, matches: dict[str, PrefixMatch], excluded: set[str],
                    allowed: frozenset[str] | None = None) -> WorkerHandle:
        """`allowed`: the only workers it may pick (admission control's verdict; None: any)."""
        pool = [w for w in self.decode.routable() if allowed is None or w.address in allowed]
        usable = prefer_others(pool, _address, excluded)
        if self.routing == "round-robin":
            i = self._round_robin("decode", usable)
        else:
            i = policy.pick_decode([_load(i, w, matches) for i, w in enumerate(usable)])
        if i is None:
            raise NoWorker("no healthy decode worker")
        return usable[i]

    def pick_prefill(self, prompt_tokens: int, matches: dict[str, PrefixMatch],
                     excluded: set[str]) -> WorkerHandle:
        usable = prefer_others(self.prefill.routable(), _address, excluded)
        if self.routing == "round-robin":
            i = self._round_robin("prefill", usable)
        else:
            i = policy.pick_prefill([_load(i, w, matches) for i, w in enumerate(usable)],
                                    prompt_tokens, self.block_size())
        if i is None:
            raise NoWorker("no healthy prefill worker")
        return usable[i]

    def prefill_remotely(self, prompt_tokens: int, d: WorkerHandle, blocks: PromptBlocks,
                         excluded: set[str]) -> bool:
        """Conditional disaggregation, with only prefill workers this request may use."""
        usable = prefer_others(self.prefill.routable(), _address, excluded)
        return policy.prefill_remotely(prompt_tokens, blocks.held_by(d) * self.block_size(),
                                       self.local_prefill_tokens, bool(usable))

    def _round_robin(self, role: str, usable: list[WorkerHandle]) -> int | None:
        if not usable:
            return None
        self._turn[role] += 1
        return self._turn[role] % len(usable)


def _address(w: WorkerHandle) -> str:
    return w.address


def _speeds(w: WorkerHandle) -> policy.TierSpeeds | None:
    """The worker's block size (its KV layout) and measured tier / prefill speeds."""
    if w.info is None or not w.info.kv_bytes_per_block:
        return None
    c = w.stats.counters
    return policy.TierSpeeds(int(w.info.kv_bytes_per_block), int(w.info.block_size or 16),
                             c.get("kv_tier_host_read_bw", 0.0), c.get("kv_tier_ssd_read_bw", 0.0),
                             c.get("kv_tier_prefill_tps", 0.0))


def _load(i: int, w: WorkerHandle, matches: dict[str, PrefixMatch]) -> policy.Load:
    s = w.stats
    m = matches.get(w.address)
    cached = (policy.weighted_blocks(m.leading, policy.tier_weights(_speeds(w)))
              if m is not None else 0.0)
    return policy.Load(i, int(s.queued_prefill_tokens), int(s.kv_blocks_used),
                       int(s.kv_blocks_total), w.inflight, cached)
