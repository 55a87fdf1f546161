"""How a decode-only step's forward runs: eager, `torch.compile`d, or CUDA graphs.

A decode-only step (every request brings one query token) is the hot loop of a decode
worker: the same short sequence of ops for every step, over a batch that changes slowly.
Mixed and prefill steps run eager: through the modules, or through `FlatDecode` where
every query row is the C++ attention's (`any_step`).

- `EagerDecode`: the model's forward as written; `FlatDecode` (`flat_decode.py`, the CPU's
  default where the model qualifies) runs the same ops without the module tree's Python.
- `CompiledDecode` (`compile_decode="inductor"`): each decoder layer through `torch.compile`
  with the inductor backend (on the CPU: C++ kernels built with gcc). One layer is traced, not
  the 30-layer model: the layers share code and their weights are graph inputs, so one graph
  serves them all, and `dynamic=True` lets it serve every batch size and context length
  (batch 1 gets its own: dynamo specialises size-1 dimensions). The first decode steps pay the
  compile; inductor caches its work on disk, so a restart is faster. Any failure (no compiler,
  an unsupported op) falls back to eager with one warning.
- `CudaGraphDecode` (`compile_decode="cuda_graphs"`, `cuda_graphs.py`): one CUDA graph per
  batch size of a ladder, inputs copied into static buffers.

Lifecycle of `CompiledDecode`: UNCOMPILED --first decode step--> COMPILED (every later step),
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
    any_step = True
    """It may run any step without a layer hook, not only decode-only ones: it is the
    modules' forward, and `FlatDecode` checks what its loop needs (every query row the C++
    attention's, as a speculative verification or a short prompt chunk has them)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def __call__(self, input_ids, positions, caches, meta, backend) -> torch.Tensor:
        return self.model(input_ids, positions, caches, meta, backend)


class _State(enum.Enum):
    UNCOMPILED = "uncompiled"
    COMPILED = "compiled"
    EAGER = "eager"


def _call_layer(layer, rope, x, cache, meta, backend):
    return layer(rope, x, cache, meta, backend)


class CompiledDecode:
    """Every layer through one torch.compile'd function; eager for good on any failure."""

    any_step = False  # decode-only steps: the trace specialises on one query token a request

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.state = _State.UNCOMPILED
        self._layer = torch.compile(_call_layer, backend="inductor", dynamic=True)

    def __call__(self, input_ids, positions, caches, meta, backend) -> torch.Tensor:
        if self.state is not _State.EAGER:
            try:
                out = self.model(input_ids, positions, caches, meta, backend,
                                 run_layer=self._layer)
                self.state = _State.COMPILED
                return out
            except Exception as exc:  # a compile or codegen failure: eager from now on
                warnings.warn(f"compile_decode='inductor' failed ({exc!s:.300}); decode "
                              "steps run eager", RuntimeWarning, stacklevel=2)
                self.state = _State.EAGER
        return self.model(input_ids, positions, caches, meta, backend)


def build_decode_step(mode: str, model: torch.nn.Module, device: torch.device, **graph_args):
    """The decode-step runner for `mode` (one of MODES); `graph_args` size the CUDA graphs."""
    if mode == "off":
        from pdserve.engine.flat_decode import FlatDecode

        return FlatDecode(model)
    if mode == "inductor":
        return CompiledDecode(model)
    if mode == "cuda_graphs":
        if device.type != "cuda":
            raise ValueError("compile_decode='cuda_graphs' needs a CUDA device")
        from pdserve.engine.cuda_graphs import CudaGraphDecode

        return CudaGraphDecode(model, device, **graph_args)
    raise ValueError(f"compile_decode must be one of {MODES}, got {mode!r}")
