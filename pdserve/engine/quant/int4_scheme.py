"""The W4A16 scheme: 4-bit weights from fp weights quantised at load, from 4-bit blocks a loader
hands over as `Int4Weight` (GGUF), or from GPTQ / AWQ checkpoints (`hf_int4`).

The LM head is a choice (`lm_head`): "dense" keeps it in the model's dtype, "bf16" multiplies by
a bf16 copy, "int4" by a 4-bit copy quantised at load; a tied embedding keeps its own
full-precision rows for the lookup whichever is chosen. bench/int4_bench.py measures what each
buys (docs/perf.md).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from pdserve.engine.layers.linear import LinearMethod
from pdserve.engine.quant.bf16 import Bf16CopyMethod
from pdserve.engine.quant.hf_int4 import HfInt4Format, adapt_hf_int4_checkpoint
from pdserve.engine.quant.int4 import Int4LinearMethod
from pdserve.engine.quant.int4_quantize import DEFAULT_GROUP_SIZE
from pdserve.engine.quant.scheme import QuantScheme, ShapesFn, Weights

LM_HEAD_CHOICES = ("dense", "bf16", "int4")
DEFAULT_LM_HEAD = "dense"


@dataclass(frozen=True)
class Int4Scheme(QuantScheme):
    checkpoint: HfInt4Format | None = None
    """The GPTQ / AWQ layout the checkpoint stores; None: dense weights (or `Int4Weight`s from
    the loader) are taken as they come."""
    group_size: int = DEFAULT_GROUP_SIZE
    """Groups of weights quantised at load (halved until they divide the input width)."""
    lm_head: str = DEFAULT_LM_HEAD
    """dense, bf16 or int4 (see the module doc)."""
    kernel: str = "auto"
    """auto, cpu, triton or reference (see `int4_kernels`)."""

    family = "int4"

    def __post_init__(self) -> None:
        if self.lm_head not in LM_HEAD_CHOICES:
            raise ValueError(f"int4 lm_head must be one of {LM_HEAD_CHOICES}, got "
                             f"{self.lm_head!r}")

    @classmethod
    def from_config(cls, qc: Mapping) -> Int4Scheme:
        return cls(checkpoint=HfInt4Format.from_config(qc))

    @property
    def key(self) -> str:
        if self.checkpoint is not None:
            return f"int4-{self.checkpoint.method}"
        return f"int4-g{self.group_size}"

    def linear_method(self) -> LinearMethod:
        # A GPTQ / AWQ checkpoint's dense linear weight would be re-quantised: refuse it.
        return Int4LinearMethod(self.group_size, self.kernel,
                                accept_dense=self.checkpoint is None)

    def lm_head_method(self, tied: bool) -> LinearMethod | None:
        if self.lm_head == "bf16":
            return Bf16CopyMethod(keep_dense=tied)
        if self.lm_head == "int4":
            return Int4LinearMethod(self.group_size, self.kernel, from_dense=True,
                                    keep_dense=tied)
        return None

    def adapt(self, weights: Weights, shapes: ShapesFn) -> Iterator[tuple[str, object]]:
        if self.checkpoint is None:
            return iter(weights)
        return adapt_hf_int4_checkpoint(weights, shapes(), self.checkpoint)
