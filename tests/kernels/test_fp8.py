"""Per-token FP8 quantisation kernel against its torch reference, and the weight helpers."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    dequantize,
    fp8_matmul,
    quantize_per_token,
    quantize_per_token_ref,
    quantize_weight_per_channel,
)


def assert_same(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]):
    assert a[0].dtype == b[0].dtype == FP8_DTYPE
    assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8))
    assert torch.equal(a[1], b[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_matches_reference_bit_for_bit(device, dtype):
    gen = torch.Generator().manual_seed(0)
    # 5000 columns: more than one 4096-wide chunk; row 2 all zeros; rows of very different size.
    x = torch.randn(4, 5000, generator=gen) * torch.tensor([[3.0], [1e-3], [0.0], [200.0]])
    x = x.to(dtype).to(device)
    assert_same(quantize_per_token(x), quantize_per_token_ref(x))


def test_rounding_of_every_e4m3_value_and_midpoint(device):
    # With amax 448 the scale is exactly 1, so each value is rounded as given: all finite E4M3
    # values, the midpoints between neighbours (ties go to even) and their neighbours, -0.0,
    # tiny values and values just over 448 (saturate).
    grid = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    grid = grid[torch.isfinite(grid)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    big = torch.tensor(1e9)
    x = torch.cat([torch.tensor([FP8_MAX]), grid, mids, mids.nextafter(big),
                   mids.nextafter(-big), torch.tensor([-0.0, 1e-30, -1e-30, 447.9, 460.0])])
    x = torch.stack([x, -x, x * 1e-20]).to(device)
    assert_same(quantize_per_token(x), quantize_per_token_ref(x))


def test_strided_rows(device):
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)).to(device)[:, :40]
    assert_same(quantize_per_token(x), quantize_per_token_ref(x))


def test_reference_error_is_within_half_an_e4m3_step():
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(2)) * 5
    q, scale = quantize_per_token_ref(x)
    assert scale.shape == (8,) and scale.dtype == torch.float32
    torch.testing.assert_close(scale, x.abs().amax(1) / FP8_MAX)
    err = (dequantize(q, scale) - x).abs()
    # 3 mantissa bits: relative step 2^-3 (half: 2^-4); subnormal step 2^-9 of the scale.
    bound = x.abs() * 2**-4 + scale[:, None] * 2**-10
    assert (err <= bound * (1 + 1e-6)).all()


def test_weight_quantisation_is_per_output_channel():
    w = torch.randn(16, 32, generator=torch.Generator().manual_seed(3))
    w[3] *= 1000
    q, scale = quantize_weight_per_channel(w)
    assert q.shape == (16, 32) and scale.shape == (16,)
    torch.testing.assert_close(scale[3] / scale[4], w[3].abs().max() / w[4].abs().max())
    rel = (dequantize(q, scale) - w).norm() / w.norm()
    assert rel < 0.05


def test_fp8_matmul_reference_approximates_the_float_product():
    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(5, 64, generator=gen), torch.randn(32, 64, generator=gen)
    xq, xs = quantize_per_token_ref(x)
    wq, ws = quantize_weight_per_channel(w)
    out = fp8_matmul(xq, xs, wq, ws, out_dtype=torch.float32)
    assert out.shape == (5, 32)
    torch.testing.assert_close(out, dequantize(xq, xs) @ dequantize(wq, ws).t())
    assert ((out - x @ w.t()).norm() / (x @ w.t()).norm()) < 0.1


def test_rejects_1d_input(device):
    with pytest.raises(ValueError, match="2-D"):
        quantize_per_token(torch.ones(8, device=device))
