"""Triton KV write against the torch reference backend's write_kv."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.attention.torch_ref import TorchAttention
from pdserve.kernels.kv_write import _kv_write_kernel, write_kv
from pdserve.kernels.runtime import is_interpreted
from tests.kernels.cases import make_case


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_matches_reference_bit_for_bit(device, dtype):
    case = make_case([3, 1, 6], [3, 10, 14], heads=6, kv_heads=3, head_dim=24, dtype=dtype,
                     seed=1, device=device)
    ours, ref = case.cache.clone(), case.cache.clone()
    write_kv(ours, case.k, case.v, case.meta.slot_mapping)
    TorchAttention().write_kv(ref, case.k, case.v, case.meta)
    assert torch.equal(ours, ref)
    # and it wrote exactly the 10 new tokens' K and V rows
    changed = (ours != case.cache).any(dim=-1).sum().item()
    assert changed == 10 * 2 * 3


def test_write_casts_to_cache_dtype(device):
    case = make_case([4], [6], seed=2, device=device)  # fp32 k, v
    ours = case.cache.to(torch.bfloat16)
    ref = ours.clone()
    write_kv(ours, case.k, case.v, case.meta.slot_mapping)
    TorchAttention().write_kv(ref, case.k, case.v, case.meta)
    if is_interpreted(_kv_write_kernel):
        # The CPU interpreter truncates fp32 -> bf16 instead of rounding: one ulp at most.
        torch.testing.assert_close(ours.float(), ref.float(), atol=0, rtol=2**-7)
    else:
        assert torch.equal(ours, ref)


def test_negative_slot_is_skipped(device):
    case = make_case([2], [2], seed=3, device=device)
    slots = case.meta.slot_mapping.clone()
    slots[0] = -1
    cache = case.cache.clone()
    write_kv(cache, case.k, case.v, slots)
    blk, off = divmod(int(slots[1]), cache.shape[3])
    torch.testing.assert_close(cache[blk, 0, :, off], case.k[1], atol=0, rtol=0)
    cache[blk, :, :, off] = case.cache[blk, :, :, off]
    assert torch.equal(cache, case.cache)  # nothing else changed


def test_rejects_wrong_kv_heads(device):
    case = make_case([1], [1], device=device)
    with pytest.raises(ValueError, match="k and v"):
        write_kv(case.cache, case.k[:, :1], case.v[:, :1], case.meta.slot_mapping)
