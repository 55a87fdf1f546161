"""Pure-torch paged attention: the reference every other backend is tested against.

Requests with a single query token (decode) are gathered into one padded batch and run as one
SDPA call; requests with several query tokens (prefill chunks, speculative verification) run
one SDPA call each, with a causal mask offset by their cached context, on 4-D inputs so that
SDPA picks its fused CPU (flash) kernel.

Gathers index a head-major view of the cache (`[2, KVH, num_blocks, bs, D]`), so the gathered
blocks of a request are already contiguous per head: the only copy is the gather itself. GQA
is handled by SDPA's `enable_gqa` (prefill) or by folding each KV head's query group into the
query-length dimension (decode), never by repeating K and V.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.engine.attention.backend import AttentionBackend
from pdserve.engine.quant.kv_fp8 import is_packed_fp8, pack_fp8, unpack_fp8


def head_major(cache: torch.Tensor) -> torch.Tensor:
    """[nb, 2, KVH, bs, D] -> view [2, KVH, nb, bs, D]."""
    return cache.permute(1, 2, 0, 3, 4)


def read_kv(stored: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """Cache rows as `dtype` (None: as stored); packed FP8 rows are dequantised."""
    if is_packed_fp8(stored):
        return unpack_fp8(stored, dtype or torch.float32)
    return stored if dtype is None else stored.to(dtype)


def gather_context(cache: torch.Tensor, blocks: torch.Tensor, length: int,
                   dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one request as [KVH, length, D] from its block ids, read as `dtype`."""
    kv = head_major(cache)[:, :, blocks]  # [2, KVH, nb, bs, D], contiguous
    two, kvh, nb, bs, d = kv.shape
    kv = read_kv(kv.reshape(two, kvh, nb * bs, d)[:, :, :length], dtype)
    return kv[0], kv[1]


def gather_batch(cache: torch.Tensor, tables: torch.Tensor, dtype: torch.dtype | None = None
                 ) -> torch.Tensor:
    """K and V of a batch as [2, KVH, B, nb * bs, D] from block tables [B, nb]."""
    kv = head_major(cache)[:, :, tables]  # [2, KVH, B, nb, bs, D]
    two, kvh, b, nb, bs, d = kv.shape
    return read_kv(kv.reshape(two, kvh, b, nb * bs, d), dtype)


def causal_mask(q_len: int, ctx_len: int, window: int | None, device) -> torch.Tensor:
    """[q_len, ctx_len] bool: query j (absolute position ctx_len - q_len + j) sees key t."""
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device).unsqueeze(1)
    k_pos = torch.arange(ctx_len, device=device).unsqueeze(0)
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


def length_groups(seqs: list[int], lens: list[int], spread: float = 1.5) -> list[list[int]]:
    """Decode requests grouped by context length (longest within `spread` x the shortest),
    so one padded gather per group copies little more than the real context."""
    groups: list[list[int]] = []
    floor = 0
    for i in sorted(seqs, key=lambda i: lens[i]):
        if not groups or lens[i] > max(floor * spread, 64):
            groups.append([])
            floor = lens[i]
        groups[-1].append(i)
    return groups


class TorchAttention(AttentionBackend):
    name = "torch"

    def write_kv(self, cache, k, v, meta):
        bs = cache.shape[3]
        slots = meta.slot_mapping
        blocks, offsets = slots // bs, slots % bs
        if is_packed_fp8(cache):  # E4M3 with a scale per (token, head), in the same row
            k, v = pack_fp8(k), pack_fp8(v)
        cache[blocks, 0, :, offsets] = k.to(cache.dtype)
        cache[blocks, 1, :, offsets] = v.to(cache.dtype)

    def attend(self, q, cache, meta, scale, sliding_window):
        qs = meta.query_start
        singles = [i for i in range(meta.num_seqs) if qs[i + 1] - qs[i] == 1]
        out = torch.empty_like(q)
        for group in length_groups(singles, meta.seq_lens):
            rows = torch.tensor([qs[i] for i in group], device=q.device)
            out[rows] = self._decode(q[rows], cache, meta, group, scale, sliding_window)
        for i in range(meta.num_seqs):
            s, e = qs[i], qs[i + 1]
            if e - s > 1:
                out[s:e] = self._prefill(q[s:e], cache, meta.block_tables[i],
                                         meta.seq_lens[i], scale, sliding_window)
        return out

    def _prefill(self, q, cache, table, ctx, scale, window):
        q_len, h, d = q.shape
        nb = -(-ctx // cache.shape[3])
        k, v = gather_context(cache, table[:nb], ctx, q.dtype)
        # 4-D inputs ([1, H, L, D]): SDPA's CPU flash kernel takes those (GQA and a boolean
        # mask included); 3-D ones fall back to its unfused math path, 2-3x slower.
        q4 = q.transpose(0, 1).unsqueeze(0)
        if q_len == ctx and window is None:  # a fresh prompt: plain causal
            o = F.scaled_dot_product_attention(q4, k[None], v[None], is_causal=True,
                                               scale=scale, enable_gqa=True)
        else:
            mask = causal_mask(q_len, ctx, window, q.device)
            o = F.scaled_dot_product_attention(q4, k[None], v[None], attn_mask=mask,
                                               scale=scale, enable_gqa=True)
        return o[0].transpose(0, 1)

    def _decode(self, q, cache, meta, seqs, scale, window):
        """q: [B, H, D], one query per request in `seqs`."""
        bs = cache.shape[3]
        index = torch.tensor(seqs, device=q.device)  # the group's order, not the batch's
        lens, tables = meta.seq_lens_t[index], meta.block_tables[index]
        nb = -(-max(meta.seq_lens[i] for i in seqs) // bs)
        kv = gather_batch(cache, tables[:, :nb], q.dtype)  # [2, KVH, B, nb * bs, D]
        _, kvh, b, _, d = kv.shape
        g = q.shape[1] // kvh
        # KV heads play SDPA's batch role and requests its head role: no copy of K or V.
        qg = q.view(b, kvh, g, d).transpose(0, 1)  # [KVH, B, G, D]
        pos = torch.arange(nb * bs, device=q.device).unsqueeze(0)
        last = (lens - 1).unsqueeze(1)
        mask = pos <= last
        if window is not None:
            mask &= pos > last - window
        o = F.scaled_dot_product_attention(qg, kv[0], kv[1], attn_mask=mask[None, :, None, :],
                                           scale=scale)  # [KVH, B, G, D]
        return o.transpose(0, 1).reshape(b, kvh * g, d)
