"""Paged multi-head latent attention (DeepSeek MLA) over the latent cache, in pure torch.

One layer's cache is `[num_blocks, 1, 1, block_size, R]` (`pdserve.engine.kv_layout`, MLA):
per token one row `[c_KV (r), k_rope (dr)]`, R = r + dr, shared by every head (FP8: each
part E4M3 with its own float32 scale, as `kv_fp8` packs a row: r + dr + 8 bytes). Per head
h, the checkpoint's `kv_b_proj` holds W_UK[h] [dn, r] and W_UV[h] [dv, r]: k_nope = W_UK c,
v = W_UV c.

Two exact forms of the same attention, chosen per request by its query length:

- absorbed (decode, speculative verification: short queries): q_lat = W_UK^T q_nope, so
  score = [q_lat, q_rope] . [c, k_rope] over the cached rows as they are (multi-query
  attention with one key "head" of width R whose values are c), and the output returns to
  the head's space through W_UV. No cached token is ever expanded: H * R per cached token.
- expanded (prefill chunks): the context's latents are up-projected once to per-head keys
  and values, then causal multi-head attention: cheaper when many queries share a context.

Decode rows are batched (grouped by context length, like `torch_ref`); other rows run one
request at a time. The Triton backend has no MLA kernel yet: this path runs on every device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.engine.attention.metadata import AttentionMetadata
from pdserve.engine.attention.torch_ref import length_groups
from pdserve.engine.quant.kv_fp8 import SCALE_BYTES, is_packed_fp8, pack_fp8, unpack_fp8

ABSORB_MAX_QUERY = 16
"""Queries of at most this many tokens take the absorbed form (decode, verification)."""


@dataclass(frozen=True)
class MLAHeads:
    """This rank's per-head up-projections, views of `kv_b_proj`'s weight [H*(dn+dv), r]."""

    kv_b: torch.Tensor
    num_heads: int
    nope_dim: int
    v_dim: int

    @property
    def w_uk(self) -> torch.Tensor:
        """[H, dn, r]"""
        return self._per_head()[:, :self.nope_dim]

    @property
    def w_uv(self) -> torch.Tensor:
        """[H, dv, r]"""
        return self._per_head()[:, self.nope_dim:]

    def _per_head(self) -> torch.Tensor:
        return self.kv_b.view(self.num_heads, self.nope_dim + self.v_dim, -1)


def write_latent(cache: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor,
                 meta: AttentionMetadata) -> None:
    """Store each new token's row (latent [T, r], rope key [T, dr]) at meta.slot_mapping.
    FP8 packs the two parts with a scale each (their magnitudes differ: the latent is
    normalised, the rope key is not): [c, scale_c, k_rope, scale_rope]."""
    bs = cache.shape[3]
    slots = meta.slot_mapping
    if is_packed_fp8(cache):
        rows = torch.cat([pack_fp8(latent), pack_fp8(rope)], dim=-1)
    else:
        rows = torch.cat([latent, rope], dim=-1)
    cache[slots // bs, 0, 0, slots % bs] = rows.to(cache.dtype)


def _rows(cache: torch.Tensor, tables: torch.Tensor, dtype: torch.dtype,
          rope_dim: int) -> torch.Tensor:
    """Cached rows of block tables [..., nb] as [..., nb * bs, R] in `dtype`."""
    got = cache[:, 0, 0][tables].flatten(-3, -2)  # [..., nb * bs, stored row]
    if not is_packed_fp8(got):
        return got.to(dtype)
    split = got.shape[-1] - (rope_dim + SCALE_BYTES)
    return torch.cat([unpack_fp8(got[..., :split], dtype), unpack_fp8(got[..., split:], dtype)],
                     dim=-1)


def mla_attend(q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
               meta: AttentionMetadata, heads: MLAHeads, scale: float) -> torch.Tensor:
    """Causal MLA of q ([T, H, dn] and [T, H, dr], rope applied) over each request's cached
    rows; returns [T, H, dv]."""
    qs = meta.query_start
    lengths = [qs[i + 1] - qs[i] for i in range(meta.num_seqs)]
    out = q_nope.new_empty(q_nope.shape[0], heads.num_heads, heads.v_dim)
    singles = [i for i, n in enumerate(lengths) if n == 1]
    for group in length_groups(singles, meta.seq_lens):
        rows = torch.tensor([qs[i] for i in group], device=q_nope.device)
        out[rows] = _decode(q_nope[rows], q_rope[rows], cache, meta, group, heads, scale)
    for i, n in enumerate(lengths):
        s, e = qs[i], qs[i + 1]
        if n == 1:
            continue
        table, ctx = meta.block_tables[i], meta.seq_lens[i]
        form = _absorbed if n <= ABSORB_MAX_QUERY else _expanded
        out[s:e] = form(q_nope[s:e], q_rope[s:e], cache, table, ctx, heads, scale)
    return out



def _absorb(q_nope: torch.Tensor, q_rope: torch.Tensor, heads: MLAHeads) -> torch.Tensor:
    """[T, H, dn], [T, H, dr] -> [T, H, r + dr]: queries in the latent space."""
    q_lat = torch.einsum("thd,hdr->thr", q_nope, heads.w_uk)
    return torch.cat([q_lat, q_rope], dim=-1)


def _decode(q_nope, q_rope, cache, meta, seqs, heads: MLAHeads, scale) -> torch.Tensor:
    """One query per request of `seqs`, batched: [B, H, dv]."""
    bs = cache.shape[3]
    index = torch.tensor(seqs, device=q_nope.device)
    lens, tables = meta.seq_lens_t[index], meta.block_tables[index]
    nb = -(-max(meta.seq_lens[i] for i in seqs) // bs)
    rows = _rows(cache, tables[:, :nb], q_nope.dtype, q_rope.shape[-1]).unsqueeze(1)
    latent = rows.shape[-1] - q_rope.shape[-1]
    q = _absorb(q_nope, q_rope, heads).unsqueeze(1)  # [B, 1, H, R]: heads as query rows
    mask = torch.arange(nb * bs, device=q.device).unsqueeze(0) <= (lens - 1).unsqueeze(1)
    o = F.scaled_dot_product_attention(q, rows, rows[..., :latent],
                                       attn_mask=mask[:, None, None, :], scale=scale)
    return torch.einsum("bhr,hvr->bhv", o.squeeze(1), heads.w_uv)


def _context(cache, table, ctx, dtype, rope_dim) -> torch.Tensor:
    nb = -(-ctx // cache.shape[3])
    return _rows(cache, table[:nb], dtype, rope_dim)[:ctx]  # [ctx, R]


def _causal(q_len: int, ctx: int, device) -> torch.Tensor:
    q_pos = torch.arange(ctx - q_len, ctx, device=device).unsqueeze(1)
    return torch.arange(ctx, device=device).unsqueeze(0) <= q_pos


def _absorbed(q_nope, q_rope, cache, table, ctx, heads: MLAHeads, scale) -> torch.Tensor:
    """A short multi-token query (verification) in latent space: [q_len, H, dv]."""
    q_len, h = q_nope.shape[:2]
    rows = _context(cache, table, ctx, q_nope.dtype, q_rope.shape[-1])
    latent = rows.shape[-1] - q_rope.shape[-1]
    q = _absorb(q_nope, q_rope, heads).reshape(1, q_len * h, -1)  # rows (token, head)
    mask = _causal(q_len, ctx, q.device).repeat_interleave(h, dim=0)
    o = F.scaled_dot_product_attention(q, rows.unsqueeze(0), rows[:, :latent].unsqueeze(0),
                                       attn_mask=mask, scale=scale)
    return torch.einsum("thr,hvr->thv", o.view(q_len, h, latent), heads.w_uv)


def _expanded(q_nope, q_rope, cache, table, ctx, heads: MLAHeads, scale) -> torch.Tensor:
    """A prefill chunk: the context's latents expanded to per-head keys and values."""
    q_len, h, dn = q_nope.shape
    rows = _context(cache, table, ctx, q_nope.dtype, q_rope.shape[-1])
    latent = rows.shape[-1] - q_rope.shape[-1]
    kv = F.linear(rows[:, :latent], heads.kv_b).view(ctx, h, dn + heads.v_dim)
    k_nope, v = kv.split([dn, heads.v_dim], dim=-1)
    k_rope = rows[:, None, latent:].expand(ctx, h, q_rope.shape[-1])
    k = torch.cat([k_nope, k_rope], dim=-1).transpose(0, 1)  # [H, ctx, dn + dr]
    q = torch.cat([q_nope, q_rope], dim=-1).transpose(0, 1)  # [H, q_len, dn + dr]
    if q_len == ctx:
        o = F.scaled_dot_product_attention(q, k, v.transpose(0, 1), is_causal=True,
                                           scale=scale)
    else:
        o = F.scaled_dot_product_attention(q, k, v.transpose(0, 1),
                                           attn_mask=_causal(q_len, ctx, q.device),
                                           scale=scale)
    return o.transpose(0, 1)
