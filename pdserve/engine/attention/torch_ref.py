"""Pure-torch paged attention: the reference every other backend is tested against.

Decode-only batches are gathered into one padded tensor and run as a single SDPA call; batches
with multi-token queries run one SDPA call per request with an explicit causal mask (offset by
the cached context, narrowed by the sliding window).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.engine.attention.backend import AttentionBackend


def gather_context(cache: torch.Tensor, blocks: torch.Tensor, length: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one request as [KVH, length, D] from its block ids."""
    kv = cache[blocks]  # [nb, 2, KVH, bs, D]
    nb, _, kvh, bs, d = kv.shape
    kv = kv.permute(1, 2, 0, 3, 4).reshape(2, kvh, nb * bs, d)[:, :, :length]
    return kv[0], kv[1]


def causal_mask(q_len: int, ctx_len: int, window: int | None, device) -> torch.Tensor:
    """[q_len, ctx_len] bool: query j (absolute position ctx_len - q_len + j) sees key t."""
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device).unsqueeze(1)
    k_pos = torch.arange(ctx_len, device=device).unsqueeze(0)
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


class TorchAttention(AttentionBackend):
    name = "torch"

    def write_kv(self, cache, k, v, meta):
        bs = cache.shape[3]
        slots = meta.slot_mapping
        blocks, offsets = slots // bs, slots % bs
        cache[blocks, 0, :, offsets] = k.to(cache.dtype)
        cache[blocks, 1, :, offsets] = v.to(cache.dtype)

    def attend(self, q, cache, meta, scale, sliding_window):
        if meta.is_decode_only:
            return self._decode(q, cache, meta, scale, sliding_window)
        out = torch.empty_like(q)
        for i, ctx in enumerate(meta.seq_lens):
            s, e = meta.query_start[i], meta.query_start[i + 1]
            nb = -(-ctx // cache.shape[3])
            k, v = gather_context(cache, meta.block_tables[i, :nb], ctx)
            qi = q[s:e].transpose(0, 1)  # [H, q, D]
            mask = None
            if e - s != ctx or sliding_window is not None:
                mask = causal_mask(e - s, ctx, sliding_window, q.device)
            o = F.scaled_dot_product_attention(
                qi, k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                is_causal=mask is None, scale=scale, enable_gqa=True)
            out[s:e] = o.transpose(0, 1)
        return out

    def _decode(self, q, cache, meta, scale, window):
        bs = cache.shape[3]
        nb = -(-meta.max_seq_len // bs)
        kv = cache[meta.block_tables[:, :nb]]  # [B, nb, 2, KVH, bs, D]
        b, _, _, kvh, _, d = kv.shape
        kv = kv.permute(2, 0, 3, 1, 4, 5).reshape(2, b, kvh, nb * bs, d).to(q.dtype)
        pos = torch.arange(nb * bs, device=q.device).unsqueeze(0)
        last = (meta.seq_lens_t - 1).unsqueeze(1)
        mask = pos <= last
        if window is not None:
            mask &= pos > last - window
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), kv[0], kv[1], attn_mask=mask[:, None, None, :],
            scale=scale, enable_gqa=True)  # q: [B, H, 1, D]
        return o.squeeze(2)
