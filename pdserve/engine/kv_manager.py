"""Request-level view of the block pool: prefix hits, slot allocation, publishing, release.

The scheduler talks to this class only; it never sees block reference counts. Every method that
changes state says so in its docstring.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kv_store.block_pool import BlockPool
from kv_store.tiers.manager import TierManager
from pdserve.block_hash import ROOT_HASH, block_hash, chain_hashes
from pdserve.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, pool: BlockPool, hash_extra: bytes,
                 tiers: TierManager | None = None,
                 copy_blocks: Callable[[list[tuple[int, int]]], None] | None = None) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.hash_extra = hash_extra
        self.tiers = tiers  # host / SSD tiers below the device pool (None: device only)
        # Copies KV between device blocks, (src, dst) pairs, on every rank (None: no copies).
        self.copy_blocks = copy_blocks

    def update_hashes(self, req: Request) -> None:
        """Extend `req.block_hashes` over every full block of its known tokens (mutates req)."""
        bs = self.block_size
        n_full = req.num_tokens // bs
        while len(req.block_hashes) < n_full:
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if req.block_hashes else ROOT_HASH
            req.block_hashes.append(
                block_hash(parent, req.token_slice(i * bs, (i + 1) * bs), self.hash_extra))

    def match_prefix(self, req: Request) -> list[int]:
        """Leading cached blocks for `req` (not taken). At least one token is left to compute,
        because the model must run on the last token to produce logits."""
        if not self.pool.enable_caching or req.params.prompt_logprobs is not None:
            return []  # prompt scoring needs the logits of every prompt position
        self.update_hashes(req)
        limit = (req.num_tokens - 1) // self.block_size
        bs = self.block_size
        return self._leading(req.block_hashes[:limit],
                             lambda i: req.token_slice(i * bs, (i + 1) * bs))

    def prefix_ready(self, req: Request) -> bool:
        """Whether `req`'s prefix can be matched now. The first time its leading run reaches
        blocks on SSD, reads of them into host memory start and this answers False until they
        landed, so the request waits for its own blocks while others run; it waits once, and
        whatever is still below the host then is loaded synchronously (mutates req)."""
        if self.tiers is None or not self.pool.enable_caching:
            return True
        if req.tier_wait is None:
            self.update_hashes(req)
            bs = self.block_size
            hashes = req.block_hashes[:(req.num_tokens - 1) // bs]
            start = len(self._device_run(hashes, lambda i: req.token_slice(i * bs, (i + 1) * bs)))
            req.tier_wait = self.tiers.stage(
                hashes[start:], [req.token_slice(i * bs, (i + 1) * bs)
                                 for i in range(start, len(hashes))])
        return not (req.tier_wait and self.tiers.pending(req.tier_wait))

    def pin_leading(self, token_ids: Sequence[int], start: int, end: int) -> list[int]:
        """Take a reference on the run of blocks [start, end) of `token_ids` held here,
        stopping at the first miss: device hits (hash and token ids), continued into the
        host/SSD tiers by loading into fresh device blocks (mutates the pool; `unpin` undoes
        it). Pinned blocks are never reused, so their KV can be read outside a step."""
        if not self.pool.enable_caching or not 0 <= start < end:
            return []
        bs = self.block_size
        end = min(end, len(token_ids) // bs)
        parent = ROOT_HASH
        if start > 0:
            parent = chain_hashes(token_ids[:start * bs], bs, self.hash_extra)[-1]
        hashes = chain_hashes(token_ids[:end * bs], bs, self.hash_extra, parent, start)
        blocks = self._leading(hashes, lambda i: list(token_ids[(start + i) * bs:
                                                                (start + i + 1) * bs]))
        for b in blocks:
            self.pool.take(b)
        return blocks

    def unpin(self, block_ids: Sequence[int]) -> None:
        """Drop the references `pin_leading` took, deepest first (mutates the pool)."""
        self.pool.free(list(reversed(block_ids)))

    def _leading(self, hashes: Sequence[bytes], tokens_of: Callable[[int], list[int]]
                 ) -> list[int]:
        """Device blocks of the leading run of `hashes` (block i holds `tokens_of(i)`),
        continued into the lower tiers; all left cached-free or as they were (not taken)."""
        hits = self._device_run(hashes, tokens_of)
        if self.tiers is not None and len(hits) < len(hashes):
            hits = self._promote(hashes, tokens_of, hits)
        return hits

    def _device_run(self, hashes: Sequence[bytes], tokens_of: Callable[[int], list[int]]
                    ) -> list[int]:
        """Device blocks of the leading run of `hashes` in the pool (pure lookup)."""
        hits: list[int] = []
        for i, h in enumerate(hashes):
            block = self.pool.lookup(h, tokens_of(i))
            if block is None:
                break
            hits.append(block)
        return hits

    def _promote(self, hashes: Sequence[bytes], tokens_of: Callable[[int], list[int]],
                 hits: list[int]) -> list[int]:
        """Continue a prefix hit into the host/SSD tiers: load the run of lower-tier blocks
        that is faster to load than to recompute into fresh device blocks, publish them and
        return them with the device hits, all cached-free again (mutates the pool: the new
        blocks are cached; `admit` takes them like any device hit)."""
        assert self.tiers is not None
        start = len(hits)
        hashes = list(hashes[start:])
        tokens = [tokens_of(i) for i in range(start, start + len(hashes))]
        k = self.tiers.plan(self.tiers.find_run(hashes, tokens))
        k = min(k, self.pool.num_free - sum(1 for b in hits if self.pool.ref_count(b) == 0))
        if k <= 0:
            return hits
        for b in hits:  # hold the device hits so the allocation below cannot evict them
            self.pool.take(b)
        new = self.pool.allocate(k)
        assert new is not None
        n = self.tiers.load(new, hashes[:k], tokens[:k])
        for i in range(n):
            self.pool.cache_block(new[i], hashes[i], tokens[i])
        self.pool.free(new[n:])  # uncached: first to be reused
        self.pool.free(list(reversed(hits + new[:n])))
        return hits + new[:n]

    def admit(self, req: Request, cached_blocks: list[int], num_new_tokens: int) -> bool:
        """Take the prefix hit and allocate room for `num_new_tokens` more (mutates req and the
        pool on success; changes nothing on failure). Blocks the request held before (a
        settled pull's) are dropped once the hit has taken its own references to them."""
        bs = self.block_size
        computed = len(cached_blocks) * bs
        need = cdiv(computed + num_new_tokens, bs) - len(cached_blocks)
        # Cached-free blocks we are about to take must not be counted as allocatable.
        taken_from_free = sum(1 for b in cached_blocks if self.pool.ref_count(b) == 0)
        if need > self.pool.num_free - taken_from_free:
            return False
        held = req.block_ids
        for b in cached_blocks:
            self.pool.take(b)
        new = self.pool.allocate(need)
        assert new is not None
        req.block_ids = cached_blocks + new
        req.num_computed_tokens = computed
        self.pool.free(list(reversed(held)))
        return True

    def reserve_pull(self, req: Request, source_blocks: int) -> tuple[int, list[int]] | None:
        """Hold what a pull of `req`'s leading blocks needs: our own leading blocks [0, c)
        pinned, fresh blocks for [c, m) where m is what the source holds, one token short of
        the request's end (the last token is always computed). Returns (c, fresh blocks), or
        None with nothing held when there is nothing to pull: we hold as much, no block is
        free, or cached blocks could never be found (mutates req.block_ids and the pool)."""
        if not self.pool.enable_caching:
            return None
        limit = min(source_blocks, (req.num_tokens - 1) // self.block_size)
        own = self.pin_leading(req.all_token_ids, 0, limit)
        fresh = self.pool.allocate(max(0, min(limit - len(own), self.pool.num_free))) or []
        if not fresh:
            self.unpin(own)
            return None
        req.block_ids = own + fresh
        return len(own), fresh

    def settle_pull(self, req: Request, start: int, landed: int) -> int:
        """A pull into `req.block_ids[start:]` is over and `landed` leading blocks of it hold
        their KV: publish those under their hashes (first writer wins: a block computed
        meanwhile stays the findable one), free the rest; returns how many landed. Nothing
        may write the freed blocks any more (the caller stopped the transfer first)."""
        self.update_hashes(req)
        bs, fresh = self.block_size, req.block_ids[start:]
        landed = max(0, min(landed, len(fresh)))
        for i in range(start, start + landed):
            self.pool.cache_block(req.block_ids[i], req.block_hashes[i],
                                  req.token_slice(i * bs, (i + 1) * bs))
        self.pool.free(list(reversed(fresh[landed:])))
        del req.block_ids[start + landed:]
        return landed

    def grow(self, req: Request, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` beyond `req.num_computed_tokens` (mutates on success)."""
        need = cdiv(req.num_computed_tokens + num_new_tokens, self.block_size) - len(req.block_ids)
        if need <= 0:
            return True
        new = self.pool.allocate(need)
        if new is None:
            return False
        req.block_ids.extend(new)
        return True

    def publish(self, req: Request) -> None:
        """Register every full, computed block of `req` under its hash (mutates the pool)."""
        if not self.pool.enable_caching:
            return
        self.update_hashes(req)
        bs = self.block_size
        n = min(req.num_computed_tokens // bs, len(req.block_hashes), len(req.block_ids))
        for i in range(req.num_published_blocks, n):
            self.pool.cache_block(req.block_ids[i], req.block_hashes[i],
                                  req.token_slice(i * bs, (i + 1) * bs))
        req.num_published_blocks = max(req.num_published_blocks, n)

    def release(self, req: Request) -> None:
        """Drop every block of `req`, deepest first so shared roots are evicted last."""
        self.pool.free(list(reversed(req.block_ids)))
        req.block_ids = []
        req.num_published_blocks = 0

    def fork(self, parent: Request, child: Request) -> bool:
        """Give `child` (the same prompt) the KV of every prompt token but the last: a
        reference to each of the parent's full blocks, and a copy of the block the last
        prompt token falls in, up to that token (copy-on-write: the parent goes on writing
        its own). The child then computes only the last prompt token. False, changing
        nothing, when the copy has no free block or no copier (mutates child and the pool)."""
        bs = self.block_size
        upto = parent.num_prompt_tokens - 1
        keep, partial = divmod(upto, bs)
        fresh: list[int] = []
        if partial:
            if self.copy_blocks is None:
                return False
            got = self.pool.allocate(1)
            if got is None:
                return False
            fresh = got
            self.copy_blocks([(parent.block_ids[keep], fresh[0])])
        for b in parent.block_ids[:keep]:
            self.pool.take(b)
        child.block_ids = parent.block_ids[:keep] + fresh
        child.block_hashes = list(parent.block_hashes[:keep])
        child.num_published_blocks = min(keep, parent.num_published_blocks)
        child.num_computed_tokens = upto
        return True

    def trim(self, req: Request, num_tokens: int) -> None:
        """Drop blocks beyond what `num_tokens` tokens need (speculative rollback)."""
        keep = cdiv(num_tokens, self.block_size)
        if keep < len(req.block_ids):
            extra = req.block_ids[keep:]
            del req.block_ids[keep:]
            self.pool.free(list(reversed(extra)))
