"""Random paged-attention batches: ragged query segments over a shuffled, garbage-filled cache."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from pdserve.engine.attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class PagedCase:
    q: torch.Tensor
    """[T, H, D], a strided view (every other head slot of a wider tensor), like a qkv split."""
    k: torch.Tensor
    """[T, KVH, D]: the new tokens' keys, not yet in the cache."""
    v: torch.Tensor
    cache: torch.Tensor
    """[num_blocks, 2, KVH, block_size, D], every slot random (unused ones must be masked)."""
    meta: AttentionMetadata
    scale: float


def make_case(q_lens: list[int], ctx_lens: list[int], *, heads: int = 4, kv_heads: int = 2,
              head_dim: int = 16, block_size: int = 4, dtype: torch.dtype = torch.float32,
              seed: int = 0, device: torch.device | str = "cpu") -> PagedCase:
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(per_seq) + 3  # spare blocks that nobody owns
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    tables, slots, start = [], [], 0
    width = max(per_seq) + 1  # one padding column of block 0
    for q_len, ctx, n in zip(q_lens, ctx_lens, per_seq, strict=True):
        own = ids[start:start + n]
        start += n
        tables.append(own + [0] * (width - n))
        slots += [own[p // block_size] * block_size + p % block_size
                  for p in range(ctx - q_len, ctx)]
    t = sum(q_lens)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    q = rand(t, 2 * heads, head_dim)[:, ::2]
    qs = [0]
    for n in q_lens:
        qs.append(qs[-1] + n)

    def ints(x):
        return torch.tensor(x, dtype=torch.int64, device=device)

    meta = AttentionMetadata(
        query_start=qs, seq_lens=list(ctx_lens), block_tables=ints(tables),
        slot_mapping=ints(slots), seq_lens_t=ints(ctx_lens), query_start_t=ints(qs),
        max_query_len=max(q_lens), max_seq_len=max(ctx_lens))
    return PagedCase(q=q, k=rand(t, kv_heads, head_dim), v=rand(t, kv_heads, head_dim),
                     cache=rand(num_blocks, 2, kv_heads, block_size, head_dim), meta=meta,
                     scale=head_dim ** -0.5)


def with_packed_fp8_cache(case: PagedCase, q_lens: list[int], ctx_lens: list[int],
                          seed: int = 0) -> PagedCase:
    """`case` with its cache replaced by a packed FP8 one (uint8 rows: head_dim E4M3 bytes and
    an fp32 scale), every slot packed by the torch reference: first random rows everywhere,
    then every context token of the batch."""
    from pdserve.engine.attention.torch_ref import TorchAttention

    h, kvh, d = case.q.shape[1], case.cache.shape[2], case.q.shape[2]
    nb, _, _, bs, _ = case.cache.shape
    full = make_case(ctx_lens, ctx_lens, heads=h, kv_heads=kvh, head_dim=d, block_size=bs,
                     dtype=case.q.dtype, seed=seed, device=case.q.device)
    assert torch.equal(full.meta.block_tables, case.meta.block_tables)
    cache = torch.zeros((nb, 2, kvh, bs, d + 4), dtype=torch.uint8, device=case.q.device)
    noise = make_case([nb * bs], [nb * bs], heads=h, kv_heads=kvh, head_dim=d, block_size=bs,
                      dtype=case.q.dtype, seed=seed + 1, device=case.q.device)
    everywhere = torch.arange(nb * bs, device=case.q.device)
    ref = TorchAttention()
    ref.write_kv(cache, noise.k, noise.v, replace(noise.meta, slot_mapping=everywhere))
    ref.write_kv(cache, full.k, full.v, full.meta)
    return replace(case, cache=cache)
