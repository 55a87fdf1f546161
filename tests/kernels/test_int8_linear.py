"""The C++ int8 x fp32 matmul (`pdserve_quant::int8_linear`, the LM head's 8-bit copy) against
the dequantised weight in float64: every build this machine can run (AVX-512, AVX2, plain C++)
gives the same products, for row counts around its tile of 8 and widths around its vectors;
a row's result does not depend on the batch, bitwise."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from pdserve.engine.quant.int8_head import quantize_groups
from pdserve.kernels import cpu as cpu_kernels

# (rows of x, rows of w, inputs, group): groups of 32 and whole rows, widths that leave a
# scalar tail after the vectors, row counts around the kernel's tile of 8.
SHAPES = [(1, 64, 576, 32), (3, 37, 24, 24), (8, 50, 130, 130), (9, 200, 96, 32),
          (17, 64, 7, 7), (2, 16, 40, 20)]


def _case(m: int, n: int, k: int, group: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, scale = quantize_groups(torch.randn(n, k, generator=g), group)
    return torch.randn(m, k, generator=g), q, scale


def _check(ops) -> None:
    for m, n, k, group in SHAPES:
        x, q, scale = _case(m, n, k, group)
        got = ops.int8_linear(x, q, scale)
        want = x.double() @ (q.double() * scale.double().repeat_interleave(group, 1)).t()
        assert got.dtype == torch.float32 and got.shape == (m, n)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * k)
        rows = torch.cat([ops.int8_linear(x[i:i + 1], q, scale) for i in range(m)])
        assert torch.equal(got, rows)


def test_int8_matmul_equals_the_dequantised_weight_and_ignores_the_batch():
    ops = cpu_kernels.load_quant_ops()
    assert ops is not None, "the quant kernels must build on this machine"
    _check(ops)


_ISA_SCRIPT = """
import sys, torch
from pdserve.kernels import cpu
from tests.kernels.test_int8_linear import _check
ops = cpu.load_quant_ops(sys.argv[1])
assert ops is not None
_check(ops)
print("ok")
"""


@pytest.mark.parametrize("isa", ["avx2", "generic"])
def test_narrower_builds_give_the_same_products(isa):
    # One library per process (the ops share a name), so each build runs in its own.
    if isa == "avx2" and cpu_kernels.best_isa() == "generic":
        pytest.skip("this CPU has no AVX2")
    out = subprocess.run([sys.executable, "-c", _ISA_SCRIPT, isa], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_bad_inputs_are_refused_with_a_reason():
    ops = cpu_kernels.load_quant_ops()
    x, q, scale = _case(2, 8, 32, 16)
    with pytest.raises(RuntimeError, match="fp32"):
        ops.int8_linear(x.double(), q, scale)
    with pytest.raises(RuntimeError, match="shapes"):
        ops.int8_linear(x[:, :8], q, scale)
    with pytest.raises(RuntimeError, match="shapes"):
        ops.int8_linear(x, q, scale[:4])
    with pytest.raises(RuntimeError, match="shapes"):
        ops.int8_linear(x, q, torch.ones(8, 3))  # 3 groups do not divide 32 inputs


def test_groups_are_symmetric_and_keep_zero_groups():
    w = torch.tensor([[1.0, -2.0, 0.5, 4.0], [0.0, 0.0, 0.0, 0.0]])
    q, scale = quantize_groups(w, 2)
    assert q.dtype == torch.int8
    assert q.tolist() == [[64, -127, 16, 127], [0, 0, 0, 0]]
    assert scale.tolist() == [pytest.approx([2 / 127, 4 / 127]), [1.0, 1.0]]
    with pytest.raises(ValueError, match="do not divide"):
        quantize_groups(w, 3)
