"""The C++ per-layer ops (`pdserve_layers::rms_norm`, `add_rms_norm`, `rotary`, `silu_mul`)
against the torch expressions they replace: rotary bitwise (also from strided q/k views, as a
fused qkv projection gives them), silu_mul bitwise where built for torch's own ISA (within
rounding on the narrower builds), the norms within a few ulp; and the layers use them only
where they apply (CPU, fp32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.layers.norm import RMSNorm
from pdserve.engine.layers.rotary import rotate_half
from pdserve.kernels import cpu as cpu_kernels


def _check_layer_ops(ops) -> None:
    g = torch.Generator().manual_seed(0)
    for t, d in ((1, 576), (5, 64), (33, 20)):
        x = torch.randn(t, d, generator=g) * 3
        r = torch.randn(t, d, generator=g)
        w = torch.randn(d, generator=g)
        norm = RMSNorm(d, 1e-5)
        norm.weight.data.copy_(w)
        want = norm.reference(x)
        torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), want, rtol=4e-7, atol=1e-7)
        s, y = ops.add_rms_norm(x, r, w, 1e-5)
        assert torch.equal(s, x + r)
        torch.testing.assert_close(y, norm.reference(x + r), rtol=4e-7, atol=1e-7)
    for t, h, kvh, d in ((1, 9, 3, 64), (7, 4, 2, 16), (3, 2, 1, 6)):
        qkv = torch.randn(t, (h + 2 * kvh) * d, generator=g)
        q = qkv[:, : h * d].view(t, h, d)  # strided rows, as the fused projection gives them
        k = qkv[:, h * d: (h + kvh) * d].view(t, kvh, d)
        cos = torch.randn(t, 1, d, generator=g)
        sin = torch.randn(t, 1, d, generator=g)
        qo, ko = ops.rotary(q, k, cos, sin)
        assert torch.equal(qo, q * cos + rotate_half(q) * sin)
        assert torch.equal(ko, k * cos + rotate_half(k) * sin)
    for t, i in SILU_SHAPES:
        x, want = _silu_case(t, i)
        torch.testing.assert_close(ops.silu_mul(x), want, rtol=2e-6, atol=1e-7)


# The MLP's width, batches of 1 and more, widths with a tail past ATen's two-vector chunks.
SILU_SHAPES = ((1, 1536), (3, 1536), (2, 37), (5, 48), (1, 17))


def _silu_case(t: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(t, 2 * i, generator=torch.Generator().manual_seed(i)) * 6
    x[0, :4] = torch.tensor([0.0, -100.0, 100.0, -0.0])
    gate, up = x.chunk(2, dim=-1)
    return x, F.silu(gate) * up


def test_layer_ops_equal_the_torch_expressions():
    ops = cpu_kernels.load_layer_ops()
    assert ops is not None
    _check_layer_ops(ops)
    # Built for the ISA torch dispatches to, silu_mul is the expression bitwise, so the
    # modules' MLP and the C++ decode loop agree with the torch reference exactly.
    for t, i in SILU_SHAPES:
        x, want = _silu_case(t, i)
        assert torch.equal(ops.silu_mul(x), want)
    with pytest.raises(RuntimeError, match="silu_mul"):
        ops.silu_mul(torch.randn(2, 5))


def test_norm_uses_the_op_in_fp32_and_the_reference_otherwise():
    norm = RMSNorm(64, 1e-6, torch.bfloat16)
    x = torch.randn(3, 64).bfloat16()
    assert torch.equal(norm(x), norm.reference(x))
    norm32 = RMSNorm(64, 1e-6)
    x = torch.randn(2, 4, 64)  # a per-head norm's 3-D input keeps its shape
    out = norm32(x)
    assert out.shape == x.shape
    torch.testing.assert_close(out, norm32.reference(x), rtol=4e-7, atol=1e-7)
