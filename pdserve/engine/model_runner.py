"""Executes a `StepPlan` on the model: builds the flat batch, runs the forward, samples.

The runner owns the model, the paged KV caches and the sampler; it knows nothing about queues.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.attention.backend import AttentionBackend
from pdserve.engine.attention.metadata import AttentionMetadata
from pdserve.engine.decode_step import build_decode_step
from pdserve.engine.models.llama import LayerHook
from pdserve.engine.sampler import Sampler, SamplerOutput, SamplingRow
from pdserve.engine.scheduler import ScheduledChunk
from pdserve.engine.spec.features import FeatureSpec, StepFeatures


@dataclass(frozen=True)
class BatchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_index: torch.Tensor  # rows of the hidden states whose logits are needed
    prompt_index: torch.Tensor | None = None  # rows scored for prompt logprobs (chunk order)


@dataclass(frozen=True)
class ForwardOutput:
    logits: torch.Tensor
    """fp32 [sampled rows, V], in plan order (`num_samples` per chunk)."""
    prompt_logits: torch.Tensor | None = None
    """fp32 [scored rows, V]: `num_prompt_logits` leading positions per chunk, in plan order;
    None when no chunk asked."""
    features: StepFeatures | None = None
    """The target features of every token, when the step asked for them."""


def build_inputs(chunks: Sequence[ScheduledChunk], block_size: int,
                 device: torch.device) -> BatchInputs:
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start = [0]
    seq_lens: list[int] = []
    sample_rows: list[int] = []
    prompt_rows: list[int] = []
    for c in chunks:
        n = len(c.token_ids)
        ids.extend(c.token_ids)
        pos = range(c.start, c.start + n)
        positions.extend(pos)
        slots.extend(c.block_ids[p // block_size] * block_size + p % block_size for p in pos)
        end = query_start[-1] + n
        sample_rows.extend(range(end - c.num_samples, end))
        prompt_rows.extend(range(query_start[-1], query_start[-1] + c.num_prompt_logits))
        query_start.append(end)
        seq_lens.append(c.start + n)
    max_blocks = max(len(c.block_ids) for c in chunks)
    tables = [c.block_ids + [0] * (max_blocks - len(c.block_ids)) for c in chunks]

    def t(x):
        return torch.tensor(x, dtype=torch.int64, device=device)

    meta = AttentionMetadata(
        query_start=query_start, seq_lens=seq_lens, block_tables=t(tables),
        slot_mapping=t(slots), seq_lens_t=t(seq_lens), query_start_t=t(query_start),
        max_query_len=max(len(c.token_ids) for c in chunks), max_seq_len=max(seq_lens))
    return BatchInputs(t(ids), t(positions), meta, t(sample_rows),
                       t(prompt_rows) if prompt_rows else None)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, caches: list[torch.Tensor],
                 backend: AttentionBackend, block_size: int, device: torch.device,
                 before_forward: Callable[[Sequence[ScheduledChunk], dict | None], None]
                 | None = None, compile_decode: str = "off",
                 graph_limits: dict | None = None) -> None:
        """`compile_decode`: see EngineConfig; `graph_limits`: CudaGraphDecode's sizes."""
        self.model = model
        self.caches = caches
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        # Tensor parallelism: rank 0 broadcasts each step to the follower ranks first.
        self.before_forward = before_forward
        # Decode-only steps through a compiled forward when the backend can be traced.
        traceable = compile_decode != "off" and backend.traceable(caches[0])
        self.decode_step = build_decode_step(compile_decode if traceable else "off",
                                             model, device, **(graph_limits or {}))

    @torch.inference_mode()
    def logits(self, chunks: Sequence[ScheduledChunk], layer_hook: LayerHook | None = None,
               tp_extra: dict | None = None) -> torch.Tensor:
        """Run the forward for a plan; fp32 logits of every sampled position, in plan order.
        `tp_extra` travels to the follower ranks with the step (e.g. KV sends)."""
        return self.forward(chunks, layer_hook, tp_extra).logits

    @torch.inference_mode()
    def forward(self, chunks: Sequence[ScheduledChunk], layer_hook: LayerHook | None = None,
                tp_extra: dict | None = None, features: FeatureSpec | None = None
                ) -> ForwardOutput:
        """`logits`, plus the logits of the positions chunks score for prompt logprobs, and
        with a `FeatureSpec` the target features of every token of the plan (what a learned
        drafter reads; `pdserve.engine.spec.features`). Every tensor-parallel rank runs this
        same sequence (the LM head gathers across ranks)."""
        if self.before_forward is not None:
            self.before_forward(chunks, tp_extra)
        batch = build_inputs(chunks, self.block_size, self.device)
        meta = self.backend.prepare(batch.meta)  # once per step, not once per layer
        feats = None
        if features is not None:  # eager: the compiled decode step returns no features
            hidden, aux = self.model.forward_features(
                batch.input_ids, batch.positions, self.caches, meta, self.backend,
                layer_hook, features.aux_layers)
            feats = StepFeatures(hidden, torch.cat(aux, dim=-1) if aux else None,
                                 tuple(meta.query_start))
        elif layer_hook is None and (meta.is_decode_only or self.decode_step.any_step):
            hidden = self.decode_step(batch.input_ids, batch.positions, self.caches, meta,
                                      self.backend)
        else:
            hidden = self.model(batch.input_ids, batch.positions, self.caches, meta,
                                self.backend, layer_hook)
        if batch.sample_index.numel() == 0:
            logits = hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32)
        else:
            logits = self.model.compute_logits(hidden[batch.sample_index]).float()
        prompt = None
        if batch.prompt_index is not None:
            prompt = self.model.compute_logits(hidden[batch.prompt_index]).float()
        return ForwardOutput(logits, prompt, feats)

    @torch.inference_mode()
    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy the KV of each (src, dst) block pair, every layer (this rank's heads)."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for cache in self.caches:
            cache.index_copy_(0, dst, cache.index_select(0, src))

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        return self.sampler(logits, rows)
