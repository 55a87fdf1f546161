"""`EngineConfig.batch_invariant`: what makes a token's numbers independent of its step.

A row's result changes with the batch wherever a kernel picks its method by the batch's size:
the int4 matmul (a GEMV to 16 rows, register-blocked panels to 127, tiles through at::mm
above), a dense matmul (MKL blocks by M), and attention (the C++ kernel for query segments of
up to 16 tokens, SDPA over a gather for longer ones, so how a prompt was chunked mattered).
The mode fixes one method for every row:

- every linear layer through the int4 panel kernel at any M (`int4_kernel="cpu-invariant"`:
  one FMA chain per output, in order over K), the LM head through the int8 kernel (whose
  tiles keep its GEMV's order: invariant already);
- every query row through the C++ paged attention, prefill chunks included
  (`CpuPagedAttention(every_row=True)`): a row's scores, softmax and sum over V depend only on
  its own query and keys.

The per-row ops between them (RMSNorm, rotary, SiLU, residual adds) and the sampler already
compute each row alone. `check_model` refuses, at load, a model with any layer that would
multiply another way, naming it.
"""

from __future__ import annotations

import torch

from pdserve.engine.quant.int4 import Int4LinearMethod
from pdserve.engine.quant.int8_head import Int8HeadMethod

INT4_KERNEL = "cpu-invariant"


def check_model(model: torch.nn.Module) -> None:
    """Raise ValueError if a layer of `model` multiplies in a way that depends on the batch."""
    for name, module in model.named_modules():
        method = getattr(module, "method", None)
        if method is None:
            continue
        if isinstance(method, Int4LinearMethod) and method.kernel is not None \
                and method.kernel.name == INT4_KERNEL:
            continue
        if isinstance(method, Int8HeadMethod) and method.on_kernel:
            continue
        what = type(method).__name__
        if isinstance(method, Int4LinearMethod) and method.kernel is not None:
            what += f" (kernel {method.kernel.name})"
        raise ValueError(f"batch_invariant=True needs every linear layer on the int4 CPU "
                         f"kernel and the LM head on the int8 kernel; {name} multiplies "
                         f"through {what}, whose rounding depends on the batch (run an int4 "
                         "model, e.g. a Q4 GGUF, or quantization='int4')")
