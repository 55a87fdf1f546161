"""The C++ decode loop's table (`pdserve_layers.FlatDecoder`, kernels/cpu/flat_decoder.cpp)
refuses what it cannot run with a clear error, at build time or at the step; its bits against
the Python loop and the modules are in tests/engine/test_flat_decode.py."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.layers.native import NativeKind
from pdserve.kernels import cpu as cpu_kernels


@pytest.fixture(scope="module")
def decoder():
    if cpu_kernels.load_ops() is None or cpu_kernels.load_layer_ops() is None:
        pytest.fail("the CPU kernels did not build")
    return torch.classes.pdserve_layers.FlatDecoder


def test_linears_are_checked_as_they_are_added(decoder):
    d = decoder()
    w = torch.zeros(8, 8)
    assert d.add_linear(int(NativeKind.DENSE), [w], 0, None, None) == 0
    with pytest.raises(RuntimeError, match="unknown linear kind 7"):
        d.add_linear(7, [w], 0, None, None)
    with pytest.raises(RuntimeError, match="a dense linear takes"):
        d.add_linear(int(NativeKind.DENSE), [w, w], 0, None, None)
    with pytest.raises(RuntimeError, match="a dense linear takes"):
        d.add_linear(int(NativeKind.INT4), [w], 32, None, None)
    with pytest.raises(RuntimeError, match="bias is a post_bias"):
        d.add_linear(int(NativeKind.INT4), [w, w, w], 32, torch.zeros(8), None)


def test_layers_and_steps_are_checked(decoder):
    d = decoder()
    i = d.add_linear(int(NativeKind.DENSE), [torch.zeros(8, 8)], 0, None, None)
    norm = torch.ones(8)
    with pytest.raises(RuntimeError, match="no linear 1"):
        d.add_layer(norm, 1e-5, i, 8, 8, 1, norm, 1e-5, i, i, 1, 1, 8, 1.0, 0)
    with pytest.raises(RuntimeError, match="sizes do not match the heads"):
        d.add_layer(norm, 1e-5, i, 8, 8, i, norm, 1e-5, i, i, 2, 1, 8, 1.0, 0)
    d.add_layer(norm, 1e-5, i, 8, 8, i, norm, 1e-5, i, i, 1, 1, 8, 1.0, 0)
    assert d.num_layers() == 1
    x, empty = torch.zeros(1, 8), torch.zeros(0, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="1 layers, 2 caches"):
        d.forward(x, x, x, [x, x], empty, empty, empty, empty, empty)
