"""The C++ quantised matmuls of `pdserve_layers` against their dequantised weights in float64:
`int8_linear` (the LM head's 8-bit copy) and `int4_linear` (W4A16 on the CPU). Every build
this machine can run (AVX-512, AVX2, plain C++) gives the same products, for row counts
around the tiles and widths around the vectors. A row's result does not depend on the other
rows, bitwise: for the int8 head at any M, for int4 within the GEMV's rows and within the
panels' (tests/helpers/int4_rows.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from pdserve.engine.quant.int8_head import quantize_groups
from pdserve.kernels import cpu as cpu_kernels
from pdserve.kernels.int4_pack import pack_block32
from tests.helpers.int4_rows import GEMV_ROWS, LAST_PANEL_ROW

# (rows of x, rows of w, inputs, group): groups of 32 and whole rows, widths that leave a
# scalar tail after the vectors, row counts around the kernel's tile of 8.
# Rows of x from 17 to 127 take the register-tiled path (groups a multiple of the vector):
# row counts around its 4 or 2 activation rows and 48 weight rows per task.
SHAPES = [(1, 64, 576, 32), (3, 37, 24, 24), (8, 50, 130, 130), (9, 200, 96, 32),
          (17, 64, 7, 7), (2, 16, 40, 20), (17, 50, 64, 32), (32, 97, 576, 32),
          (43, 5, 96, 48), (127, 49, 32, 16)]


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


# (rows of x, rows of w, inputs, group): one, two, three blocks per group and groups of 16;
# row counts that leave partial quads of weight rows and partial tiles of 8 activation rows;
# M = 1 (four weight rows at once), the GEMV's rows, the panel kernel's narrow and wide
# panels (to 383 rows: a short prompt too), and 384 (dequantise, then oneDNN or at::mm).
INT4_SHAPES = [(1, 64, 576, 32), (1, 37, 96, 32), (3, 50, 128, 16), (9, 10, 256, 128),
               (16, 33, 1536, 64), (20, 70, 64, 64), (1, 6, 64, 16), (2, 5, 96, 32),
               (6, 21, 128, 32), (13, 40, 192, 32),
               (32, 97, 576, 32), (45, 13, 288, 32), (127, 50, 160, 16), (128, 7, 64, 32),
               (384, 7, 64, 32)]


def _int4_case(m: int, n: int, k: int, group: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = (torch.rand(n, k // group, generator=g) * 0.02).half()
    offset = (torch.randn(n, k // group, generator=g) * 0.05).half()
    w = q.float().view(n, k // group, group) * scale.float()[..., None]
    w = (w + offset.float()[..., None]).view(n, k)
    return torch.randn(m, k, generator=g), pack_block32(q), scale, offset, w


def _check_int4(ops, isa: str) -> None:
    for m, n, k, group in INT4_SHAPES:
        x, packed, scale, offset, w = _int4_case(m, n, k, group)
        assert torch.equal(ops.int4_dequantize(packed, scale, offset, group), w)
        got = ops.int4_linear(x, packed, scale, offset, group)
        want = x.double() @ w.double().t()
        assert got.dtype == torch.float32 and got.shape == (m, n)
        torch.testing.assert_close(got.double(), want, rtol=0,
                                   atol=2e-6 * want.abs().max().item())
        # The row-wise op (batch-invariant mode): one kernel at every M, each row's bits
        # those of the row alone, within rounding of float64.
        rowwise = ops.int4_linear_rowwise(x, packed, scale, offset, group)
        torch.testing.assert_close(rowwise.double(), want, rtol=0,
                                   atol=2e-6 * want.abs().max().item())
        assert torch.equal(rowwise, torch.cat([
            ops.int4_linear_rowwise(x[i:i + 1], packed, scale, offset, group)
            for i in range(m)]))
        if m <= GEMV_ROWS[isa]:
            alone = torch.cat([ops.int4_linear(x[i:i + 1], packed, scale, offset, group)
                               for i in range(m)])
            assert torch.equal(got, alone)
        elif m <= LAST_PANEL_ROW[isa]:
            # The same rows in a batch of another size (another panel shape or number of
            # panels, padding).
            more = torch.randn(LAST_PANEL_ROW[isa] - m, k,
                               generator=torch.Generator().manual_seed(1))
            other = torch.cat([x, more]) if m < 64 else x[:17]
            part = ops.int4_linear(other, packed, scale, offset, group)
            rows = min(m, other.shape[0])
            assert torch.equal(got[:rows], part[:rows])


def test_int8_matmul_equals_the_dequantised_weight_and_ignores_the_batch():
    ops = cpu_kernels.load_layer_ops()
    assert ops is not None, "the quant kernels must build on this machine"
    _check(ops)


def test_int4_matmul_equals_the_dequantised_weight_and_ignores_the_batch():
    ops = cpu_kernels.load_layer_ops()
    _check_int4(ops, cpu_kernels.best_isa())
    with pytest.raises(RuntimeError, match="power of two"):
        x, packed, scale, offset, _ = _int4_case(1, 4, 96, 32)
        ops.int4_linear(x, packed, scale, offset, 48)
    with pytest.raises(RuntimeError, match="shapes"):
        ops.int4_linear(x, packed[:, :-16], scale, offset, 32)
    with pytest.raises(RuntimeError, match="fp16"):
        ops.int4_linear(x, packed, scale.float(), offset, 32)


_ISA_SCRIPT = """
import sys, torch
from pdserve.kernels import cpu
from tests.kernels.test_layer_ops import _check_layer_ops
from tests.kernels.test_quant_kernels import _check, _check_int4
ops = cpu.load_layer_ops(sys.argv[1])
assert ops is not None
_check(ops)
_check_int4(ops, sys.argv[1])
_check_layer_ops(ops)
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
    ops = cpu_kernels.load_layer_ops()
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
