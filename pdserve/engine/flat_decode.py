"""A step without the module tree's per-layer Python: the CPU's eager fast path.

On the real default model (30 narrow layers) at batch 1 the kernels take about 8 ms of a 12 ms
decode step; most of the rest was Python between them: nine module calls a layer, each
linear's forward -> method -> kernel chain, the per-call dtype, device and cache-format
checks of the norms, rotary and attention. `FlatDecode` runs the same ops on the same
arguments in the same order as `LlamaForCausalLM.forward` (so its hidden states are the same
bits: tests/engine/test_flat_decode.py), from a table of each layer's weights and bound
matmuls built once, and makes the per-step checks once per step.

It applies to a model whose every layer is the Llama `DecoderLayer` (its `Attention` and
`MLP`) over linears that offer a `flat_forward` (dense, or 4-bit without an input permutation),
without tensor parallelism, on the CPU in fp32 with pdserve's C++ layer ops. A step runs it
when its attention is the C++ paged kernel's alone (`CpuPagedAttention.kernel_rows`): a
decode step, a speculative verification, a short prompt chunk. Any other step, or model,
runs the modules' forward (`EagerDecode`'s).

The layers run in one of two forms, the same ops in the same order either way:
- NATIVE: one call into C++ for all the layers (`FlatDecoder`, kernels/cpu/flat_decoder.cpp),
  where every linear describes its forward as data (`LinearBase.native_forward`: dense, or
  pdserve's 4-bit kernels). At batch 1 on the real model that removes ~500 Python-side op calls
  a step.
- FLAT: the Python loop over the table (`_python_layers`), for linears with only a bound
  callable (torch's own int4 kernels), or with `native=False`.

Lifecycle: UNBUILT --first step--> NATIVE or FLAT (the table is built from the loaded
weights), or --a part without a flat form--> EAGER for good.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.attention.cpu_backend import CpuPagedAttention
from pdserve.engine.decode_step import EagerDecode
from pdserve.engine.layers.linear import Matmul
from pdserve.engine.layers.native import NativeLinear
from pdserve.engine.models.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM


class FlatState(enum.Enum):
    UNBUILT = "unbuilt"
    NATIVE = "native"
    FLAT = "flat"
    EAGER = "eager"


@dataclass(frozen=True)
class FlatLayer:
    """One decoder layer's weights and bound matmuls (each linear's `flat_forward`)."""

    input_norm: torch.Tensor
    input_eps: float
    qkv: Matmul
    qkv_sizes: tuple[int, int, int]
    o: Matmul
    post_norm: torch.Tensor
    post_eps: float
    gate_up: Matmul
    down: Matmul
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    window: int
    native: tuple[NativeLinear, ...] | None
    """qkv, o, gate_up, down as data (`LinearBase.native_forward`), or None where one has no
    such form."""


def flat_layers(model: torch.nn.Module) -> list[FlatLayer] | None:
    """The table for `model`, or None when some part has no flat form (see the module doc)."""
    if (type(model).forward_features is not LlamaForCausalLM.forward_features
            or model.tp.size != 1 or not model.layers):
        return None
    out = []
    for layer in model.layers:
        if (type(layer) is not DecoderLayer or type(layer.self_attn) is not Attention
                or type(layer.mlp) is not MLP):
            return None
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        mm = [lin.flat_forward() for lin in linears]
        if any(m is None for m in mm):
            return None
        native = tuple(lin.native_forward() for lin in linears)
        q_size = attn.num_heads * attn.head_dim
        kv_size = attn.num_kv_heads * attn.head_dim
        out.append(FlatLayer(
            layer.input_layernorm.weight, layer.input_layernorm.eps, mm[0],
            (q_size, kv_size, kv_size), mm[1], layer.post_attention_layernorm.weight,
            layer.post_attention_layernorm.eps, mm[2], mm[3], attn.num_heads,
            attn.num_kv_heads, attn.head_dim, attn.scale, attn.window or 0,
            None if None in native else native))
    return out


def native_decoder(layers: Sequence[FlatLayer]):
    """`layers` as one C++ `FlatDecoder`, or None when a linear has no native form or the
    attention library (whose ops it calls) did not build."""
    from pdserve.kernels.cpu import load_ops

    if any(layer.native is None for layer in layers) or load_ops() is None:
        return None
    decoder = torch.classes.pdserve_layers.FlatDecoder()
    for layer in layers:
        qkv, o, gate_up, down = (
            decoder.add_linear(int(m.kind), list(m.tensors), m.group, m.bias, m.post_bias)
            for m in layer.native)
        decoder.add_layer(layer.input_norm, layer.input_eps, qkv, layer.qkv_sizes[0],
                          layer.qkv_sizes[1], o, layer.post_norm, layer.post_eps, gate_up, down,
                          layer.heads, layer.kv_heads, layer.head_dim, layer.scale, layer.window)
    return decoder


def _layer_ops():
    from pdserve.kernels.cpu import load_layer_ops

    return load_layer_ops()


class FlatDecode(EagerDecode):
    """The eager decode step (`decode_step.py`): the flat loop where it applies, else the
    modules' forward."""

    def __init__(self, model: torch.nn.Module, native: bool = True) -> None:
        super().__init__(model)
        self.state = FlatState.UNBUILT
        self.native = native
        """False keeps the layers in Python (FLAT) even where C++ could run them."""
        self.flat_steps = 0
        """Steps the flat loop ran (the others ran the modules' forward)."""
        self.flat_tokens = 0
        """Query tokens of those steps: more than one a request in a speculative verification
        or a short prompt chunk."""
        self._layers: Sequence[FlatLayer] = ()
        self._ops = None
        self._decoder = None

    def __call__(self, input_ids, positions, caches, meta, backend) -> torch.Tensor:
        rows = self._kernel_rows(backend, caches, meta, input_ids)
        if rows is None:
            return super().__call__(input_ids, positions, caches, meta, backend)
        self.flat_steps += 1
        self.flat_tokens += input_ids.shape[0]
        model = self.model
        x = model.embed_tokens(input_ids)
        rope = model.rotary.at(positions, x.dtype)
        if self._decoder is not None:
            x = self._decoder.forward(x, rope.cos, rope.sin, list(caches), meta.slot_mapping,
                                      meta.block_tables, meta.seq_lens_t, meta.query_start_t,
                                      rows)
        else:
            x = self._python_layers(x, rope, caches, meta, backend.ops, rows)
        return model.norm(x)

    def _python_layers(self, x, rope, caches, meta, kernels, rows) -> torch.Tensor:
        ops, t = self._ops, x.shape[0]
        layers = self._layers
        if not layers:
            return x
        # A layer's closing residual add is the next layer's add_rms_norm (the same bits as
        # the add and then rms_norm of the modules' forward); v is written from its slice.
        h = ops.rms_norm(x, layers[0].input_norm, layers[0].input_eps)
        for i, (layer, cache) in enumerate(zip(layers, caches, strict=True)):
            q, k, v = layer.qkv(h).split(layer.qkv_sizes, dim=-1)
            q, k = ops.rotary(q.view(t, layer.heads, layer.head_dim),
                              k.view(t, layer.kv_heads, layer.head_dim), rope.cos, rope.sin)
            kernels.write_kv(cache, k, v.view(t, layer.kv_heads, layer.head_dim),
                             meta.slot_mapping)
            out = torch.empty_like(q)
            kernels.paged_attention(out, q, cache, meta.block_tables, meta.seq_lens_t,
                                    meta.query_start_t, rows, layer.scale, layer.window)
            x, h = ops.add_rms_norm(x, layer.o(out.view(t, layer.heads * layer.head_dim)),
                                    layer.post_norm, layer.post_eps)
            mlp = layer.down(ops.silu_mul(layer.gate_up(h)))
            if i + 1 == len(layers):
                x = x + mlp
            else:
                nxt = layers[i + 1]
                x, h = ops.add_rms_norm(x, mlp, nxt.input_norm, nxt.input_eps)
        return x

    def _kernel_rows(self, backend, caches, meta, input_ids) -> torch.Tensor | None:
        """This step's rows for the paged kernel when the flat loop runs it, else None."""
        if self.state is FlatState.UNBUILT:
            self._build(input_ids)
        if (self.state not in (FlatState.NATIVE, FlatState.FLAT)
                or not isinstance(backend, CpuPagedAttention)):
            return None
        return backend.kernel_rows(caches[0], meta)

    def _build(self, input_ids: torch.Tensor) -> None:
        ops = _layer_ops() if input_ids.device.type == "cpu" else None
        layers = flat_layers(self.model) if ops is not None else None
        fp32 = self.model.embed_tokens.weight.dtype == torch.float32
        if layers is None or not fp32:
            self.state = FlatState.EAGER
            return
        self._layers, self._ops, self.state = layers, ops, FlatState.FLAT
        if self.native:
            self._decoder = native_decoder(layers)
            if self._decoder is not None:
                self.state = FlatState.NATIVE
