"""A model's paged-KV layout as one value: what the cache, the tiers, the transfer and the
router's cost all read, so bytes per block are never recomputed by hand.

Every layer of a model has the same layout. One layer's cache on one tensor-parallel rank is

    GQA  [num_blocks, 2, local KV heads, block_size, row]   K (plane 0) and V (plane 1)
    MLA  [num_blocks, 1, 1,              block_size, row]   the latent c_KV and the shared
                                                             rope key, one row per token

where `row` is `head_dim` elements of the model's dtype, or, when the format is FP8, E4M3
values followed by their float32 scale (`pdserve.engine.quant.kv_fp8`): `head_dim + 4` bytes
for GQA, and for MLA the latent and the rope key packed with a scale each (`head_dim + 8`).
For MLA `head_dim` is `kv_lora_rank + qk_rope_head_dim`, the latent first.

Under tensor parallelism GQA heads are split over the ranks (replicated when there are fewer
heads than ranks); the MLA row is one "head" that every rank holds whole. Both are the head
routing of `kv_store.tp_layout` over `num_kv_heads` (1 for MLA): a head several ranks hold is
sent once, by its lowest holder, to every receiving rank that needs it, so an MLA latent
travels once per receiving rank, never once per attention head.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import torch

from kv_store import tp_layout
from pdserve.engine.huge_pages import huge_page_zeros
from pdserve.engine.quant.kv_format import KVCacheFormat


class KVKind(StrEnum):
    GQA = "gqa"
    """Per-head keys and values (MHA, GQA, MQA)."""
    MLA = "mla"
    """Multi-head latent attention: one compressed latent plus a shared rope key per token."""


@dataclass(frozen=True)
class KVLayout:
    kind: KVKind
    num_layers: int
    num_kv_heads: int
    """Cached heads of the whole model (GQA: its KV heads; MLA: 1)."""
    head_dim: int
    """Elements per (token, head) before FP8 packing (MLA: latent + rope key)."""
    block_size: int
    format: KVCacheFormat
    latent_dim: int = 0
    """MLA: `kv_lora_rank`, the leading elements of a row (the rest is the rope key)."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KV layout {name} must be positive, got {getattr(self, name)}")
        if self.kind is KVKind.MLA and (self.num_kv_heads != 1
                                        or not 0 < self.latent_dim < self.head_dim):
            raise ValueError("an MLA layout has one cached head whose row is the latent then "
                             "the rope key")
        _ = self.row_dim  # FP8 rows need 4-aligned parts (raises ValueError otherwise)

    @classmethod
    def gqa(cls, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
            fmt: KVCacheFormat) -> KVLayout:
        return cls(KVKind.GQA, num_layers, num_kv_heads, head_dim, block_size, fmt)

    @classmethod
    def mla(cls, num_layers: int, kv_lora_rank: int, rope_dim: int, block_size: int,
            fmt: KVCacheFormat) -> KVLayout:
        return cls(KVKind.MLA, num_layers, 1, kv_lora_rank + rope_dim, block_size, fmt,
                   latent_dim=kv_lora_rank)

    @classmethod
    def of_model(cls, cfg, block_size: int, fmt: KVCacheFormat) -> KVLayout:
        """The layout of a `ModelConfig` (MLA when it has `mla` numbers)."""
        if cfg.mla is not None:
            return cls.mla(cfg.num_layers, cfg.mla.kv_lora_rank, cfg.mla.qk_rope_head_dim,
                           block_size, fmt)
        return cls.gqa(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, fmt)

    # -- shapes and bytes ----------------------------------------------------------------
    @property
    def planes(self) -> int:
        """2 for GQA (K and V), 1 for MLA (values are read from the latent)."""
        return 2 if self.kind is KVKind.GQA else 1

    @property
    def row_dim(self) -> int:
        """Elements of `format.storage_dtype` per (token, head) as stored (FP8 MLA: the
        latent and the rope key packed with a scale each)."""
        if self.kind is KVKind.MLA:
            return (self.format.last_dim(self.latent_dim)
                    + self.format.last_dim(self.head_dim - self.latent_dim))
        return self.format.last_dim(self.head_dim)

    def local_heads(self, tp_size: int = 1) -> int:
        """Cached heads on each rank of a group of `tp_size`."""
        return self.local_heads_of(0, tp_size)

    def local_heads_of(self, rank: int, tp_size: int) -> int:
        return len(self.heads_of(rank, tp_size))

    def cache_shape(self, num_blocks: int, tp_size: int = 1) -> tuple[int, ...]:
        """One layer's cache on one rank."""
        return (num_blocks, self.planes, self.local_heads(tp_size), self.block_size,
                self.row_dim)

    def bytes_per_block(self, tp_size: int = 1) -> int:
        """One block of one layer on one rank."""
        elems = self.planes * self.local_heads(tp_size) * self.block_size * self.row_dim
        return elems * self.format.storage_dtype.itemsize

    def block_bytes(self, tp_size: int = 1) -> int:
        """One block, every layer, on one rank: what a host or SSD tier slot holds."""
        return self.num_layers * self.bytes_per_block(tp_size)

    def bytes_per_token(self) -> int:
        """KV bytes of one token, every layer, each distinct head once: what one token adds
        to the cache of a TP=1 worker and what a transfer moves per token."""
        per_head = self.planes * self.row_dim * self.format.storage_dtype.itemsize
        return self.num_layers * self.num_kv_heads * per_head

    def transfer_bytes(self, num_tokens: int, receiver_tp: int = 1) -> int:
        """Bytes a transfer of `num_tokens` prompt tokens to a group of `receiver_tp` ranks
        moves: every block touched (a partial last one whole), each head once per receiving
        rank that holds it (an MLA row: once per rank)."""
        blocks = -(-num_tokens // self.block_size)
        heads = sum(self.local_heads_of(r, receiver_tp) for r in range(receiver_tp))
        per_head = self.planes * self.row_dim * self.format.storage_dtype.itemsize
        return blocks * self.block_size * self.num_layers * heads * per_head

    def new_caches(self, num_blocks: int, tp_size: int, device: torch.device,
                   prefault: bool = False) -> list[torch.Tensor]:
        """Zeroed caches, one per layer; `prefault`: every CPU page mapped now
        (`EngineConfig.kv_cache_prefault`)."""
        shape = self.cache_shape(num_blocks, tp_size)
        return [_zeros(shape, self.format.storage_dtype, device, prefault)
                for _ in range(self.num_layers)]

    def check_caches(self, caches: Sequence[torch.Tensor], tp_size: int = 1) -> None:
        """Raise ValueError unless `caches` are this layout's (one per layer)."""
        want = self.cache_shape(caches[0].shape[0] if caches else 0, tp_size)
        if len(caches) != self.num_layers or any(
                tuple(c.shape) != want or c.dtype != self.format.storage_dtype for c in caches):
            got = [tuple(c.shape) for c in caches[:1]]
            raise ValueError(f"KV caches {got} x {len(caches)} are not the layout's "
                             f"{want} x {self.num_layers} ({self})")

    # -- tensor parallelism (kv_store.tp_layout over the cached heads) --------------------
    def heads_of(self, rank: int, size: int) -> range:
        """Global cached heads `rank` of a group of `size` holds (MLA: head 0, every rank)."""
        return tp_layout.heads_of(self.num_kv_heads, rank, size)

    def head_routes(self, sender_rank: int, sender_size: int,
                    receivers: Sequence[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
        """(address, first head, end head) of what `sender_rank` sends each receiver
        `(address, rank, size)`; a head held by several senders is sent by its lowest."""
        return tp_layout.head_routes(self.num_kv_heads, sender_rank, sender_size, receivers)

    # -- identity ------------------------------------------------------------------------
    def hash_key(self) -> str:
        """What the block hash binds a block to, besides model and block size: the format,
        and for MLA the latent split (GQA keeps the format's name alone, so existing
        hashes are unchanged)."""
        if self.kind is KVKind.GQA:
            return str(self.format)
        return f"{self.format}|mla={self.latent_dim}+{self.head_dim - self.latent_dim}"

    def __str__(self) -> str:
        return (f"{self.kind.value}: {self.num_layers} layers x {self.num_kv_heads} heads x "
                f"{self.head_dim} ({self.format}), block {self.block_size}")


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
           prefault: bool = False) -> torch.Tensor:
    """A zeroed cache tensor. On the CPU a mapping the kernel fills with zero pages as they
    are first touched, where `torch.zeros` writes every byte up front (a worker's default
    1 GiB CPU cache cost ~1 s of page faults at start, for blocks most runs never use), on
    huge pages (`huge_pages`: fewer TLB misses, and NIXL reads land in it faster).
    `prefault`: the pages are written now instead, so no request pays for them later."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    cache = huge_page_zeros(shape, dtype)
    if prefault:
        cache.zero_()  # a write maps each page (a read would map the shared zero page)
    return cache
