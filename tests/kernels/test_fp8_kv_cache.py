"""Packed FP8 KV cache (uint8 rows: E4M3 values + fp32 scale) in the Triton kernels, against the
torch reference backend, which packs and unpacks with pdserve.engine.quant.kv_fp8."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.attention.torch_ref import TorchAttention
from pdserve.kernels.kv_write import write_kv
from pdserve.kernels.paged_attention import paged_decode_attention, paged_prefill_attention
from tests.kernels.cases import make_case, with_packed_fp8_cache
from tests.kernels.test_paged_attention import assert_close, run

pytest.importorskip("pdserve.engine.quant.kv_fp8")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_packs_like_the_reference_bit_for_bit(device, dtype):
    case = make_case([3, 1, 6], [3, 10, 14], head_dim=16, dtype=dtype, seed=1, device=device)
    case = with_packed_fp8_cache(case, [3, 1, 6], [3, 10, 14], seed=1)
    ours, ref = case.cache.clone(), case.cache.clone()
    k = case.k * torch.tensor([1.0, 1e-3], device=device)[None, :, None].to(dtype)
    k[0, 0] = 0  # an all-zero row gets the minimum scale
    write_kv(ours, k, case.v, case.meta.slot_mapping)
    TorchAttention().write_kv(ref, k, case.v, case.meta)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("dtype,window", [(torch.float32, None), (torch.bfloat16, 5)])
def test_decode_reads_packed_rows(device, dtype, window):
    q_lens, ctx = [1, 1, 1], [1, 9, 38]
    case = with_packed_fp8_cache(make_case(q_lens, ctx, dtype=dtype, seed=2, device=device),
                                 q_lens, ctx, seed=2)
    assert_close(run(paged_decode_attention, case, window, num_splits=2, tile_n=16), case,
                 window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_reads_packed_rows(device, dtype):
    q_lens, ctx = [7, 1, 12], [7, 13, 29]
    case = make_case(q_lens, ctx, head_dim=32, block_size=8, dtype=dtype, seed=3, device=device)
    case = with_packed_fp8_cache(case, q_lens, ctx, seed=3)
    assert_close(run(paged_prefill_attention, case, None, block_m=16, tile_n=16), case, None)
