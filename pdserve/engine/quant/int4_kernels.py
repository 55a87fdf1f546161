"""How a 4-bit layer multiplies on each device: a packed weight and its matmul, one interface.

    Int4Matmul.build(weight, act_dtype) -> packed copy;   .matmul(x) -> x @ w^T in x.dtype

- `cpu`: pdserve's own C++ kernel (`pdserve_layers::int4_linear`, kernels/cpu/int4_linear.cpp):
  fp32 activations, fp16 scale and offset per group, nibbles in blocks of 32 (GGUF's Q4_0 /
  Q4_1 order). On a Q4 GGUF its products are the fp32 model's up to summation order. Decode
  batches (M <= 16) go through its GEMV, whose result for a row does not depend on the other
  rows (bitwise); 17-127 rows go through a register-blocked panel kernel and prefill
  dequantises tiles and multiplies them with at::mm, each rounding in its own order. Needs K
  a multiple of 32.
- `cpu-invariant`: the same weights through one kernel at every M
  (`pdserve_layers::int4_linear_rowwise`: the panel kernel, one FMA chain per output): a row's
  result never depends on the batch or on how a prompt was chunked (the engine's
  `batch_invariant` mode); below 17 rows it computes a whole panel of 32.
- `cpu-torch`: torch's packed-int4 CPU kernels. `_convert_weight_to_int4pack_for_cpu` packs
  the values (uint8 [N, K/2], an opaque layout), `_weight_int4pack_mm_for_cpu` multiplies with
  `scales_and_zeros` [K/g, N, 2] and dequantises `(q - 8) * scale + zero`, so zero =
  offset + 8 * scale. Only its bf16 variant is vectorised (fp32 and fp16 measured 20-40x
  slower), so activations enter it as bf16 and leave in the model's dtype. Groups of 32, 64,
  128 or 256 (larger groups are split, exactly), N padded to a multiple of 16; rows
  independent of the batch. Used where pdserve's kernel did not build.
- `triton`: `pdserve.kernels.w4a16` (CUDA; on a CPU only under TRITON_INTERPRET=1, for tests).
- `reference`: dequantise the nibbles and multiply in fp32 each call. Slow; used where neither
  CPU kernel takes the shape (K not a multiple of 32 and groups of 16) and as the oracle.

Every backend keeps the weight at 4 bits per value plus one scale and one offset per group.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod

import torch

from pdserve.engine.config import INT4_KERNELS
from pdserve.engine.layers.native import NativeKind, NativeLinear
from pdserve.engine.quant.int4_weight import Int4Weight
from pdserve.kernels.int4_pack import dequantize_packed, pack_block32, pack_nibbles

log = logging.getLogger(__name__)

CPU_GROUP_SIZES = (32, 64, 128, 256)
_CPU_ROW_MULTIPLE = 16
_INNER_K_TILES = 2  # required by the op's signature; the CPU layout does not depend on it


class Int4Matmul(ABC):
    """A packed 4-bit [N, K] weight and the kernel that multiplies by it."""

    name: str = ""

    def __init__(self, weight: Int4Weight) -> None:
        self.out_features, self.in_features = weight.shape

    @abstractmethod
    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> x @ w^T [M, N] in x.dtype."""

    @abstractmethod
    def dequantize(self) -> torch.Tensor:
        """The fp32 [N, K] matrix this kernel multiplies by (tests, debugging)."""

    @abstractmethod
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The packed weight, its scales and offsets: what this kernel stores."""

    def nbytes(self) -> int:
        """Bytes the packed weight, its scales and offsets take."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def native(self) -> NativeLinear | None:
        """`matmul` as data for the C++ decode loop (`layers/native.py`), or None."""
        return None


class CpuInt4(Int4Matmul):
    name = "cpu"
    native_kind = NativeKind.INT4

    def __init__(self, weight: Int4Weight, ops) -> None:
        super().__init__(weight)
        if self.in_features % 32:
            raise ValueError(f"the CPU int4 kernel needs inputs in blocks of 32, got "
                             f"{self.in_features}")
        self.ops = ops
        self.group_size = weight.group_size
        self.packed = pack_block32(weight.qweight)
        self.scale = weight.scale.to(torch.float16).contiguous()
        self.offset = weight.offset.to(torch.float16).contiguous()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ops.int4_linear(x.float(), self.packed, self.scale, self.offset,
                                 self.group_size)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        return self.ops.int4_dequantize(self.packed, self.scale, self.offset, self.group_size)

    def native(self) -> NativeLinear | None:
        return NativeLinear(self.native_kind, (self.packed, self.scale, self.offset),
                            self.group_size)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.packed, self.scale, self.offset


class CpuRowwiseInt4(CpuInt4):
    name = "cpu-invariant"
    native_kind = NativeKind.INT4_ROWWISE

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ops.int4_linear_rowwise(x.float(), self.packed, self.scale, self.offset,
                                         self.group_size)
        return y if x.dtype == torch.float32 else y.to(x.dtype)


class CpuPackedInt4(Int4Matmul):
    name = "cpu-torch"

    def __init__(self, weight: Int4Weight, act_dtype: torch.dtype) -> None:
        super().__init__(weight)
        if act_dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"the CPU int4 kernel takes bf16 or fp16 activations, not {act_dtype}")
        g = cpu_group_size(weight.group_size)
        if g is None:
            raise ValueError(f"the CPU int4 kernel needs groups of at least 32, got "
                             f"{weight.group_size}")
        w = weight.split_groups(g)
        n, k = w.shape
        pad = -n % _CPU_ROW_MULTIPLE
        q = torch.nn.functional.pad(w.qweight.to(torch.int32), (0, 0, 0, pad))
        scale = torch.nn.functional.pad(w.scale.float(), (0, 0, 0, pad))
        zero = torch.nn.functional.pad(w.offset.float(), (0, 0, 0, pad)) + 8 * scale
        self.group_size = g
        self.act_dtype = act_dtype
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, _INNER_K_TILES)
        self.scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(act_dtype).contiguous()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(self.act_dtype).contiguous(), self.packed, self.group_size, self.scales_zeros)
        return y[:, :self.out_features].to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        # The fp32 variant of the op is exact for an identity input: it returns w^T itself.
        eye = torch.eye(self.in_features, dtype=torch.float32, device=self.packed.device)
        wt = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, self.group_size,
                                                        self.scales_zeros.float())
        return wt[:, :self.out_features].t().contiguous()

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.packed, self.scales_zeros


class TritonInt4(Int4Matmul):
    name = "triton"

    def __init__(self, weight: Int4Weight) -> None:
        super().__init__(weight)
        self.group_size = weight.group_size
        self.packed = pack_nibbles(weight.qweight)
        self.scale = weight.scale.to(torch.float16).contiguous()
        self.offset = weight.offset.to(torch.float16).contiguous()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        from pdserve.kernels.w4a16 import w4a16_matmul  # imports triton: only when used

        return w4a16_matmul(x.contiguous(), self.packed, self.scale, self.offset,
                            self.group_size)

    def dequantize(self) -> torch.Tensor:
        return dequantize_packed(self.packed, self.scale, self.offset, self.group_size)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.packed, self.scale, self.offset


class ReferenceInt4(Int4Matmul):
    name = "reference"

    def __init__(self, weight: Int4Weight) -> None:
        super().__init__(weight)
        self.group_size = weight.group_size
        self.packed = pack_nibbles(weight.qweight)
        self.scale = weight.scale.float().contiguous()
        self.offset = weight.offset.float().contiguous()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() @ self.dequantize().t()).to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        return dequantize_packed(self.packed, self.scale, self.offset, self.group_size)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.packed, self.scale, self.offset


def cpu_group_size(group_size: int) -> int | None:
    """The CPU kernel's group for a weight's group (split if larger than 256), or None."""
    fits = [g for g in CPU_GROUP_SIZES if g <= group_size and group_size % g == 0]
    return max(fits) if fits else None


def cpu_act_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """The activation dtype inside the CPU kernel: bf16 whatever the model's (an fp32 or fp16
    model's activations are rounded to bf16 for the matmul only; bf16 covers fp16's range)."""
    return torch.bfloat16


def build_int4_matmul(weight: Int4Weight, model_dtype: torch.dtype,
                      kernel: str = "auto") -> Int4Matmul:
    """The backend for this weight on its device: `kernel` is one of `INT4_KERNELS`."""
    device = weight.qweight.device
    if kernel == "auto":
        if device.type == "cuda":
            kernel = "triton"
        elif weight.shape[1] % 32 == 0 and _quant_ops() is not None:
            kernel = "cpu"
        elif cpu_group_size(weight.group_size) is not None:
            kernel = "cpu-torch"
        else:
            log.warning("no int4 CPU kernel takes a [%d, %d] layer in groups of %d; it "
                        "dequantises its weight at every call (slow)", *weight.shape,
                        weight.group_size)
            kernel = "reference"
    if kernel in ("cpu", "cpu-invariant"):
        ops = _quant_ops()
        if ops is None:
            raise ValueError("the CPU int4 kernel did not build here (see the warning); "
                             "use kernel='cpu-torch' or 'reference'")
        return (CpuInt4 if kernel == "cpu" else CpuRowwiseInt4)(weight, ops)
    if kernel == "cpu-torch":
        return CpuPackedInt4(weight, cpu_act_dtype(model_dtype))
    if kernel == "triton":
        return TritonInt4(weight)
    if kernel == "reference":
        return ReferenceInt4(weight)
    raise ValueError(f"int4 kernel must be one of {', '.join(INT4_KERNELS)}, got {kernel!r}")


def _quant_ops():
    from pdserve.kernels.cpu import load_layer_ops

    return load_layer_ops()
