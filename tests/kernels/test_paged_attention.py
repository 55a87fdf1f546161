"""Triton paged attention against the torch reference backend (the oracle), on tiny shapes.

The oracle runs in fp32 on upcast copies of the same inputs, so a bf16 kernel's error is its own
rounding (products in bf16, probabilities rounded to bf16 before P @ V, output rounding).
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.attention.torch_ref import TorchAttention
from pdserve.kernels.paged_attention import paged_decode_attention, paged_prefill_attention
from tests.kernels.cases import PagedCase, make_case

# Max |kernel - fp32 reference| per dtype. bf16: outputs are O(1), one bf16 ulp there is 2^-7.
ATOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def reference(case: PagedCase, window: int | None) -> torch.Tensor:
    packed = case.cache.dtype == torch.uint8  # FP8 rows: the reference dequantises them itself
    cache = case.cache if packed else case.cache.float()
    return TorchAttention().attend(case.q.float(), cache, case.meta, case.scale, window)


def run(kernel, case: PagedCase, window: int | None, **kw) -> torch.Tensor:
    m = case.meta
    return kernel(case.q, case.cache, m.block_tables, m.seq_lens_t, m.query_start_t,
                  case.scale, window, **kw)


def assert_close(out: torch.Tensor, case: PagedCase, window: int | None) -> None:
    ref = reference(case, window)
    assert out.dtype == case.q.dtype and out.shape == case.q.shape
    assert torch.isfinite(out).all()
    err = (out.float() - ref).abs().max().item()
    assert err <= ATOL[case.q.dtype], f"max abs error {err}"
    if case.q.dtype != torch.float32:  # and the error is rounding noise, not a wrong term
        rel = ((out.float() - ref).norm() / ref.norm()).item()
        assert rel < 1e-2, f"relative error {rel}"


@pytest.mark.parametrize("dtype,window,splits", [
    (torch.float32, None, 1),
    (torch.float32, None, 3),
    (torch.float32, 5, 2),
    (torch.bfloat16, None, 2),
    (torch.bfloat16, 7, 1),
])
def test_decode_matches_reference(device, dtype, window, splits):
    # Contexts of 1 token, under a tile, and over several 16-token tiles of 4-token blocks.
    case = make_case([1, 1, 1], [1, 9, 38], dtype=dtype, seed=splits, device=device)
    out = run(paged_decode_attention, case, window, num_splits=splits, tile_n=16)
    assert_close(out, case, window)


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 1), (2, 2)])
def test_decode_handles_any_query_group_size(device, heads, kv_heads):
    case = make_case([1, 1], [13, 21], heads=heads, kv_heads=kv_heads, head_dim=24,
                     block_size=8, seed=heads, device=device)
    assert_close(run(paged_decode_attention, case, None, num_splits=2, tile_n=16), case, None)


def test_decode_splits_agree_with_each_other(device):
    case = make_case([1, 1], [5, 70], seed=9, device=device)
    one = run(paged_decode_attention, case, None, num_splits=1, tile_n=16)
    many = run(paged_decode_attention, case, None, num_splits=4, tile_n=16)
    torch.testing.assert_close(one, many, atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_ragged_with_cached_prefix(device, dtype):
    # A fresh prompt, a single decode row, and a chunk after 17 cached tokens: several query
    # tiles (block_m 16, G 2 -> 8 tokens a tile) and several key tiles.
    case = make_case([7, 1, 12], [7, 13, 29], head_dim=32, block_size=8, dtype=dtype, seed=4,
                     device=device)
    out = run(paged_prefill_attention, case, None, block_m=16, tile_n=16)
    assert_close(out, case, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_several_tokens_per_request(device, dtype):
    # Speculative verification: 4 query tokens after a cached context, GQA 6:2.
    case = make_case([4, 4, 4], [9, 20, 33], heads=6, kv_heads=2, dtype=dtype, seed=5,
                     device=device)
    assert_close(run(paged_prefill_attention, case, None, tile_n=16), case, None)


@pytest.mark.parametrize("window", [1, 6])
def test_prefill_sliding_window(device, window):
    case = make_case([10, 3, 1], [10, 25, 18], heads=4, kv_heads=1, head_dim=24, seed=6,
                     device=device)
    assert_close(run(paged_prefill_attention, case, window, block_m=16, tile_n=16), case,
                 window)


def test_prefill_kernel_on_single_tokens_equals_decode_kernel(device):
    case = make_case([1, 1, 1], [3, 17, 30], block_size=16, seed=7, device=device)
    dec = run(paged_decode_attention, case, 8, num_splits=1)
    pre = run(paged_prefill_attention, case, 8)
    torch.testing.assert_close(dec, pre, atol=1e-6, rtol=0)


def test_rejects_mismatched_head_dim(device):
    case = make_case([1], [4], device=device)
    m = case.meta
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode_attention(case.q[..., :8], case.cache, m.block_tables, m.seq_lens_t,
                               m.query_start_t, case.scale)
