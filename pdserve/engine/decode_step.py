"""How a decode-only step's forward runs: eager, `torch.compile`d (CPU), or CUDA graphs.

A decode-only step (every request brings one query token, plus at most a few speculative ones)
is the hot loop of a decode worker: the same short sequence of ops for every step, over a batch
that changes slowly. Mixed and prefill steps always run eager.

- `EagerDecode`: the model's forward as written.
- `CompiledDecode` (`compile_decode="inductor"`): the forward through `torch.compile` with
  the inductor CPU backend (C++ kernels built with gcc), `dynamic=True` so one graph serves
  every batch size and context length; batch 1 gets its own (dynamo specialises size-1
  dimensions). The first decode step pays the compile (tens of seconds on 2 cores; inductor
  caches its work on disk, so a restart is faster). Inductor is imported lazily and any
  failure (no compiler, an unsupported op) falls back to eager with one warning.
- `CudaGraphDecode` (CUDA, `compile_decode="cuda_graphs"`, in `cuda_graphs.py`): one graph
  per batch size of a ladder, inputs copied into static buffers.

Lifecycle of a compiled step: UNCOMPILED --first decode step--> COMPILED (every later step),
or --compile error--> EAGER (warned once, for good).
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Callable

import torch

MODES = ("off", "inductor", "cuda_graphs")

Forward = Callable[..., torch.Tensor]


class EagerDecode:
    def __init__(self, forward: Forward) -> None:
        self.forward = forward

    def __call__(self, *args) -> torch.Tensor:
        return self.forward(*args)


class _State(enum.Enum):
    UNCOMPILED = "uncompiled"
    COMPILED = "compiled"
    EAGER = "eager"


class CompiledDecode:
    """`forward` through torch.compile (inductor), falling back to eager on any failure."""

    def __init__(self, forward: Forward) -> None:
        self.forward = forward
        self.state = _State.UNCOMPILED
        self._compiled: Forward | None = None

    def __call__(self, *args) -> torch.Tensor:
        if self.state is _State.EAGER:
            return self.forward(*args)
        try:
            if self._compiled is None:
                self._compiled = torch.compile(self.forward, backend="inductor", dynamic=True)
            out = self._compiled(*args)
        except Exception as exc:  # a compile or codegen failure: eager from now on
            warnings.warn(f"compile_decode='inductor' failed ({exc!s:.300}); decode steps "
                          "run eager", RuntimeWarning, stacklevel=2)
            self.state = _State.EAGER
            return self.forward(*args)
        self.state = _State.COMPILED
        return out


def build_decode_step(mode: str, forward: Forward, device: torch.device, **cuda_graph_args):
    """The decode-step runner for `mode` (one of MODES)."""
    if mode == "off":
        return EagerDecode(forward)
    if mode == "inductor":
        return CompiledDecode(forward)
    if mode == "cuda_graphs":
        if device.type != "cuda":
            raise ValueError("compile_decode='cuda_graphs' needs a CUDA device")
        from pdserve.engine.cuda_graphs import CudaGraphDecode

        return CudaGraphDecode(forward, device, **cuda_graph_args)
    raise ValueError(f"compile_decode must be one of {MODES}, got {mode!r}")
