"""The engine-facing side of speculative decoding: when to propose, how to verify, what to count.

    execute(step N) ──► observe(features): a learned drafter's target hidden states
    apply_results(step N) ──► propose(scheduler): the drafter extends over what step N
        verified (`Proposer.extend`), then k per request (policy), drafts (proposer)
        └► req.spec_token_ids = drafts          (scheduled with the decode token in step N+1)
    execute(step N+1) ──► sample(): verify the drafts against the target's logits
        └► accepted drafts + 1 token per request; the scheduler rolls rejected KV back
    scheduler release (finish / preemption) ──► on_release: drop drafts and drafter state

Proposing at the end of a step (rather than at the start of the next) keeps the workers'
`schedule` / `execute` / `apply_results` sequence speculative without any change on their
side. A request activated between steps (a decode worker's remotely prefilled request) runs
its first decode step without drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

import torch

from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampler import Sampler, SamplingRow, TokenLogprobs
from pdserve.engine.scheduler import ScheduledChunk, Scheduler
from pdserve.engine.spec.adaptive import (
    AdaptiveConfig,
    AdaptiveK,
    CostModel,
    FixedK,
    default_compute_bound_tokens,
)
from pdserve.engine.spec.config import HEAD_METHODS, SpecConfig
from pdserve.engine.spec.features import FeatureSpec, StepFeatures
from pdserve.engine.spec.ngram import NgramProposer
from pdserve.engine.spec.proposer import Proposal, Proposer
from pdserve.engine.spec.stats import SpecStats
from pdserve.engine.spec.verifier import sample_step

if TYPE_CHECKING:
    from pdserve.engine.engine import LLMEngine


class KPolicy(Protocol):
    last_k: int

    def choose(self, request_ids: Sequence[str], batch_size: int) -> dict[str, int]: ...
    def observe(self, request_id: str, proposed: int, accepted: int) -> None: ...
    def forget(self, request_id: str) -> None: ...
    @property
    def global_acceptance(self) -> float: ...


class SpeculativeDecoder:
    def __init__(self, proposer: Proposer, policy: KPolicy, max_k: int, max_model_len: int,
                 max_step_tokens: int) -> None:
        self.proposer = proposer
        self.policy = policy
        self.max_k = max_k
        self.max_model_len = max_model_len
        self.max_step_tokens = max_step_tokens
        self.counters = SpecStats()
        self._pending: dict[str, Proposal] = {}
        self._features: tuple[Sequence[ScheduledChunk], StepFeatures] | None = None

    @property
    def feature_spec(self) -> FeatureSpec | None:
        """What the drafter reads from each target forward (None: nothing)."""
        return self.proposer.feature_spec

    def observe(self, chunks: Sequence[ScheduledChunk], features: StepFeatures) -> None:
        """The target's features of the step being executed; used once it is applied."""
        self._features = (chunks, features)

    @torch.inference_mode()
    def propose(self, scheduler: Scheduler) -> None:
        """Set `spec_token_ids` on every running request in decode (mutates the requests).
        Only once a request has an output token: a prompt whose last token alone is left (a
        prefix hit up to it, a forked choice) samples its first token plainly, as it would
        have uncached, so a seeded request's first token never depends on the cache."""
        if self._features is not None:
            chunks, features = self._features
            self._features = None
            self.proposer.extend(chunks, features, scheduler.requests)
        decoding = [r for r in scheduler.running if r.status is RequestStatus.RUNNING
                    and r.output_token_ids and r.num_tokens - r.num_computed_tokens == 1]
        if not decoding:
            return
        chosen = self.policy.choose([r.request_id for r in decoding], len(scheduler.running))
        caps = {r.request_id: min(chosen.get(r.request_id, 0), self._room(r)) for r in decoding}
        asked = [r for r in decoding if caps[r.request_id] > 0]
        proposals = self.proposer.propose(asked, caps) if asked else {}
        for r in decoding:
            prop = proposals.get(r.request_id)
            if prop is None:
                r.spec_token_ids = []
                self._pending.pop(r.request_id, None)
                self.counters.steps_without_drafts += 1
                continue
            r.spec_token_ids = list(prop.token_ids[:caps[r.request_id]])
            self._pending[r.request_id] = prop

    def _room(self, r: Request) -> int:
        """Most drafts worth verifying: the step emits k + 1 tokens at most."""
        left = min(r.params.max_tokens - len(r.output_token_ids), self.max_model_len - r.num_tokens)
        return max(0, min(self.max_k, left - 1, self.max_step_tokens - 1))

    @torch.inference_mode()
    def sample(self, sampler: Sampler, chunks: Sequence[ScheduledChunk], logits: torch.Tensor,
               rows: Sequence[SamplingRow]
               ) -> tuple[dict[str, list[int]], dict[str, list[TokenLogprobs | None]]]:
        """Tokens (accepted drafts + one) and logprobs per sampling request of the step."""
        proposals = {c.request_id: p for c in chunks
                     if (p := self._pending.pop(c.request_id, None)) is not None}
        result = sample_step(sampler, chunks, logits, rows, proposals)
        for o in result.outcomes:
            self.counters.record(o.num_proposed, o.num_accepted)
            self.policy.observe(o.request_id, o.num_proposed, o.num_accepted)
        return result.sampled, result.logprobs

    def on_release(self, req: Request) -> None:
        """Scheduler listener: the request gave its blocks back (finished or preempted)."""
        self._pending.pop(req.request_id, None)
        if req.status is RequestStatus.WAITING:
            self.proposer.on_preempt(req.request_id)
            return
        self.proposer.on_finish(req.request_id)
        self.policy.forget(req.request_id)

    def is_idle(self) -> bool:
        return not self._pending and self.proposer.is_idle()

    def stats(self) -> dict[str, float]:
        return {**self.counters.as_dict(), "spec_k": self.policy.last_k,
                "spec_acceptance_ema": self.policy.global_acceptance}


def spec_stats_off() -> dict[str, float]:
    """The same keys as `SpeculativeDecoder.stats`, for an engine without speculation."""
    return {**SpecStats().as_dict(), "spec_k": 0, "spec_acceptance_ema": 0.0}


def build_speculator(engine: LLMEngine) -> SpeculativeDecoder | None:
    """The engine's speculative decoder from `engine.config.speculative_config` (None: off)."""
    raw = engine.config.speculative_config
    if raw is None:
        return None
    cfg = SpecConfig.from_dict(raw)
    proposer = _proposer(cfg, engine)
    k = cfg.num_speculative_tokens
    policy: KPolicy = FixedK(k)
    if cfg.adaptive:
        knee = cfg.compute_bound_tokens or default_compute_bound_tokens(engine.device.type)
        policy = AdaptiveK(AdaptiveConfig(max_k=k, cost=CostModel(knee,
                                                                   proposer.draft_cost_ratio)))
    return SpeculativeDecoder(proposer, policy, k, engine.max_model_len,
                              engine.config.max_num_batched_tokens)


def _proposer(cfg: SpecConfig, engine: LLMEngine) -> Proposer:
    if cfg.method == "ngram":
        return NgramProposer(cfg.prompt_lookup_max, cfg.prompt_lookup_min)
    if cfg.method in (*HEAD_METHODS, "mtp"):
        from pdserve.engine.spec.heads import build_head_proposer

        return build_head_proposer(cfg, engine)
    from pdserve.engine.spec.draft_model import DraftModelProposer

    draft = _draft_engine(cfg, engine)
    ratio = _num_params(draft.runner.model) / max(1, _num_params(engine.runner.model))
    return DraftModelProposer(draft, engine.eos_token_ids, greedy=cfg.draft_greedy,
                              catchup_budget=engine.config.max_num_batched_tokens,
                              draft_cost_ratio=ratio)


def _draft_engine(cfg: SpecConfig, engine: LLMEngine) -> LLMEngine:
    """A second engine of the target's class for the draft model: same device, dtype, block
    size and context length; its own block pool, without prefix caching or speculation."""
    ec = engine.config
    blocks = cfg.draft_num_gpu_blocks or engine.pool.num_blocks + ec.max_num_seqs
    draft_config = replace(
        ec, model=str(cfg.model), dtype=str(engine.dtype).removeprefix("torch."),
        device=str(engine.device), num_gpu_blocks=blocks, kv_cache_memory_gb=None,
        max_model_len=engine.max_model_len, enable_prefix_caching=False,
        tensor_parallel_size=1, quantization=None, kv_cache_dtype="auto",
        speculative_config=None, model_id="")
    draft = type(engine)(draft_config)
    if draft.vocab_size != engine.vocab_size:
        raise ValueError(f"speculative_config.model has vocab_size {draft.vocab_size}; the "
                         f"target's is {engine.vocab_size} (the draft must share the tokenizer)")
    return draft


def _num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
