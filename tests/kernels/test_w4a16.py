"""The W4A16 Triton kernel against the torch reference (dequantise, multiply in fp32)."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.int4_pack import pack_nibbles, unpack_nibbles, w4a16_matmul_ref
from pdserve.kernels.w4a16 import w4a16_matmul

# Output rounding only: the kernel's fp32 sum differs from the reference's in order.
_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _weight(n: int, k: int, group: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(n, k // group, generator=gen) * 0.1 + 1e-3).half()
    offset = (-8 * scale.float() + torch.randn(n, k // group, generator=gen) * 0.05).half()
    return pack_nibbles(q), scale, offset


def test_nibbles_round_trip_and_layout():
    q = torch.randint(0, 16, (3, 10), dtype=torch.uint8)
    packed = pack_nibbles(q)
    assert packed.shape == (3, 5) and torch.equal(unpack_nibbles(packed), q)
    assert packed[0, 0].item() == q[0, 0].item() | (q[0, 1].item() << 4)  # even k: low nibble


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,group", [(1, 80, 128, 32), (17, 64, 64, 16), (3, 40, 256, 128),
                                         (5, 16, 512, 256)])
def test_kernel_matches_reference(device, dtype, m, n, k, group):
    packed, scale, offset = (t.to(device) for t in _weight(n, k, group, seed=m))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(dtype).to(device)
    got = w4a16_matmul(x, packed, scale, offset, group)
    want = w4a16_matmul_ref(x, packed, scale, offset, group)
    assert got.dtype == dtype and got.shape == (m, n)
    tol = _TOL[dtype] * want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=tol)


def test_rows_past_the_first_block_and_strided_input(device):
    packed, scale, offset = (t.to(device) for t in _weight(24, 64, 32))
    x = torch.randn(40, 96).to(device)[:, :64]  # row stride 96
    torch.testing.assert_close(w4a16_matmul(x, packed, scale, offset, 32),
                               w4a16_matmul_ref(x, packed, scale, offset, 32),
                               rtol=1e-5, atol=1e-4)


def test_bad_shapes_are_refused(device):
    packed, scale, offset = (t.to(device) for t in _weight(16, 64, 32))
    x = torch.randn(2, 64).to(device)
    with pytest.raises(ValueError, match="packed"):
        w4a16_matmul(torch.randn(2, 32).to(device), packed, scale, offset, 32)
    with pytest.raises(ValueError, match="scale"):
        w4a16_matmul(x, packed, scale[:, :1].contiguous(), offset, 32)
    with pytest.raises(ValueError, match="group_size"):
        w4a16_matmul(x, packed, scale, offset, 24)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_engine_picks_triton_on_cuda_and_matches_the_reference():
    from pdserve.engine.quant.int4_kernels import build_int4_matmul
    from pdserve.engine.quant.int4_quantize import quantize_int4

    w = quantize_int4(torch.randn(1536, 576, device="cuda"), 64)
    kernel = build_int4_matmul(w, torch.bfloat16)
    assert kernel.name == "triton"
    x = torch.randn(16, 576, device="cuda", dtype=torch.bfloat16)
    want = x.float() @ w.dequantize().t()
    torch.testing.assert_close(kernel.matmul(x).float(), want, rtol=0,
                               atol=2e-2 * want.abs().max().item())


def test_a_linear_layer_on_the_triton_kernel(device):
    """The engine's W4A16 method with the Triton backend (what CUDA runs), act order included."""
    from pdserve.engine.layers.linear import ColumnParallelLinear
    from pdserve.engine.quant.int4 import Int4LinearMethod
    from pdserve.engine.quant.int4_quantize import quantize_int4
    from pdserve.engine.quant.int4_weight import Int4Weight

    gen = torch.Generator().manual_seed(3)
    w = quantize_int4(torch.randn(48, 64, generator=gen), 32)
    order = torch.randperm(64, generator=gen)
    w = Int4Weight(w.qweight, w.scale, w.offset, 32, column_order=order)
    with torch.device(device):
        layer = ColumnParallelLinear(64, 48, bias=True)
    method = Int4LinearMethod(kernel="triton")
    layer.method = method
    method.prepare(layer)
    layer.weight_loader(layer.weight, w.to(device))
    layer.weight_loader(layer.bias, torch.arange(48.0, device=device))
    method.finalize(layer)
    assert method.kernel.name == "triton"
    x = torch.randn(5, 64, generator=gen).to(device)
    want = x @ w.dequantize().to(device).t() + torch.arange(48.0, device=device)
    torch.testing.assert_close(layer(x), want, rtol=0, atol=2e-3 * want.abs().max().item())
