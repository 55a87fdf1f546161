"""`kernels.onednn.linear`: F.linear's product, through oneDNN for fp32 CPU tensors while
torch.backends.mkldnn.enabled; F.linear itself otherwise."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import onednn

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                reason="torch built without oneDNN")


def _tensors(m: int = 33, k: int = 96, n: int = 40):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(m, k, generator=g), torch.randn(n, k, generator=g),
            torch.randn(n, generator=g))


@pytest.mark.parametrize("shape", [(33, 96), (2, 5, 96), (96,)])
def test_the_product_is_f_linear_s_up_to_rounding(shape):
    _, w, b = _tensors()
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    assert onednn.takes(x, w)
    got = onednn.linear(x, w, b)
    want = (x.double() @ w.double().t() + b.double()).float()
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())


def test_a_strided_input_is_taken_as_its_contiguous_copy():
    x, w, b = _tensors()
    strided = x.t().contiguous().t()
    assert not strided.is_contiguous()
    assert torch.equal(onednn.linear(strided, w, b), onednn.linear(x, w, b))


def test_what_it_does_not_take_is_f_linear_bit_for_bit(monkeypatch):
    x, w, b = _tensors()
    for xs, ws in ((x.double(), w.double()), (x.bfloat16(), w.bfloat16()), (x[:0], w)):
        assert not onednn.takes(xs, ws)
        assert torch.equal(onednn.linear(xs, ws), F.linear(xs, ws))
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    assert not onednn.takes(x, w)
    assert torch.equal(onednn.linear(x, w, b), F.linear(x, w, b))
