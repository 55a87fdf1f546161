"""The W4A16 scheme: 4-bit weights from fp weights quantised at load, from 4-bit blocks a loader
hands over as `Int4Weight` (GGUF), or from GPTQ / AWQ checkpoints (`hf_int4`). Linear layers
take `Int4LinearMethod`, MoE routed experts `Int4ExpertsMethod` (the same groups, kernel and
TP rule; a GPTQ / AWQ MoE checkpoint's `experts.<e>.<w>.qweight` parts reach the experts'
loader as `Int4Weight`s by the same adapter as any layer's).

The LM head's precision is its own option (`EngineConfig.lm_head_dtype`, see `lm_head`); this
scheme's default for it is `DEFAULT_LM_HEAD`, chosen from bench/int4_bench.py's measurements
(docs/perf.md).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from pdserve.engine.layers.linear import LinearMethod
from pdserve.engine.layers.moe import ExpertsMethod
from pdserve.engine.quant.hf_int4 import HfInt4Format, adapt_hf_int4_checkpoint
from pdserve.engine.quant.int4 import Int4LinearMethod
from pdserve.engine.quant.int4_experts import Int4ExpertsMethod
from pdserve.engine.quant.int4_quantize import DEFAULT_GROUP_SIZE
from pdserve.engine.quant.scheme import QuantScheme, ShapesFn, Weights

DEFAULT_LM_HEAD = "int8"


@dataclass(frozen=True)
class Int4Scheme(QuantScheme):
    checkpoint: HfInt4Format | None = None
    """The GPTQ / AWQ layout the checkpoint stores; None: dense weights (or `Int4Weight`s from
    the loader) are taken as they come."""
    group_size: int = DEFAULT_GROUP_SIZE
    """Groups of weights quantised at load (halved until they divide the input width)."""
    kernel: str = "auto"
    """auto, cpu, triton or reference (see `int4_kernels`)."""

    family = "int4"
    default_lm_head = DEFAULT_LM_HEAD

    @classmethod
    def from_config(cls, qc: Mapping) -> Int4Scheme:
        return cls(checkpoint=HfInt4Format.from_config(qc))

    @property
    def key(self) -> str:
        # A named kernel is part of the key: torch's rounds activations to bf16, so KV made
        # under it is not the KV of pdserve's fp32 kernel.
        kernel = "" if self.kernel == "auto" else f"-{self.kernel}"
        if self.checkpoint is not None:
            return f"int4-{self.checkpoint.method}{kernel}"
        return f"int4-g{self.group_size}{kernel}"

    def linear_method(self) -> LinearMethod:
        # A GPTQ / AWQ checkpoint's dense linear weight would be re-quantised: refuse it.
        return Int4LinearMethod(self.group_size, self.kernel,
                                accept_dense=self.checkpoint is None)

    def experts_method(self) -> ExpertsMethod:
        return Int4ExpertsMethod(self.group_size, self.kernel,
                                 accept_dense=self.checkpoint is None)

    def adapt(self, weights: Weights, shapes: ShapesFn) -> Iterator[tuple[str, object]]:
        if self.checkpoint is None:
            return iter(weights)
        return adapt_hf_int4_checkpoint(weights, shapes(), self.checkpoint)
