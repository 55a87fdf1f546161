"""The engine loop: admit requests, schedule a step, run it, apply stop rules, report.

Used directly by the workers (token ids in, `StepOutput`s out) and wrapped by `LLM` for
offline use. A `layer_hook` passed to `step()` runs after each layer's KV is written.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from kv_store.block_pool import BlockPool
from kv_store.tiers.manager import TierManager, tier_stats_off
from pdserve.block_hash import hash_extra
from pdserve.engine.attention.backend import get_backend
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_manager import KVCacheManager
from pdserve.engine.loader import load_model
from pdserve.engine.model_config import ModelConfig, parse_dtype
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.models.llama import LayerHook
from pdserve.engine.outputs import StepOutput
from pdserve.engine.parallel import SINGLE, ParallelContext
from pdserve.engine.quant.kv_format import KVCacheFormat
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampler import SamplingRow, TokenLogprobs
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig, StepPlan
from pdserve.engine.spec import build_speculator, spec_stats_off
from pdserve.engine.stop import apply_stop_rules

# Blocks copied to the host tier ahead of eviction per step (busy) and per idle tick.
DEMOTE_AHEAD_PER_STEP = 2
DEMOTE_AHEAD_WHEN_IDLE = 16
# How long an engine with nothing to run but requests waiting for SSD reads pauses per step.
IO_STALL_WAIT_S = 0.001


class LLMEngine:
    def __init__(self, config: EngineConfig, tp: ParallelContext = SINGLE,
                 on_block_event=None, tp_role: str = "engine") -> None:
        self.config = config
        self.model_dir = Path(config.model)
        self.model_config = ModelConfig.from_pretrained(self.model_dir)
        self.model_id = config.model_id or self.model_dir.name
        self.device = _resolve_device(config.device)
        self.dtype = _resolve_dtype(config.dtype, self.model_config)
        self.max_model_len = config.max_model_len or min(
            self.model_config.max_position_embeddings, 32768)
        self.eos_token_ids = frozenset(_eos_ids(self.model_dir, self.model_config))
        self.tp_driver = None
        if config.tensor_parallel_size > 1 and tp.size == 1:
            from pdserve.engine.tp.driver import TPDriver, check_divisible

            check_divisible(self.model_config, config.tensor_parallel_size,
                            config.enable_expert_parallel)
            # Rank 0 of a new TP group; `tp_role` picks the followers' worker plugin.
            self.tp_driver = TPDriver(config, self.device, follower_args=("--role", tp_role))
            tp = self.tp_driver.context
        tp = dataclasses.replace(tp, expert_parallel=config.enable_expert_parallel)
        self.tp = tp
        try:
            model = load_model(self.model_dir, self.model_config, self.dtype, self.device, tp,
                               self.max_model_len, quantization=config.quantization)
        except BaseException:
            self.close()
            raise
        # A layout description; str() of it is the block hash's kv-dtype key.
        self.kv_dtype = KVCacheFormat.from_config(config.kv_cache_dtype, self.dtype)
        num_blocks = config.num_gpu_blocks or self._auto_num_blocks(model)
        caches = self._allocate_caches(model, num_blocks)
        if self.tp_driver is not None:
            self.tp_driver.setup(num_blocks)
        self.pool = BlockPool(num_blocks, config.block_size, config.enable_prefix_caching,
                              on_event=on_block_event)
        # The hash binds a block to everything that decides its bytes, weight quantisation too.
        kv_key = f"{self.kv_dtype}|w={config.quantization or 'none'}"
        self.tiers = self._build_tiers(caches, on_block_event)
        if self.tiers is not None:
            self.pool.set_evict_listener(self.tiers.demote)
        kv = KVCacheManager(self.pool, hash_extra(self.model_id, kv_key, config.block_size),
                            tiers=self.tiers)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs, max_model_len=self.max_model_len), kv)
        self.runner = ModelRunner(model, caches, get_backend(config.attention_backend),
                                  config.block_size, self.device,
                                  self.tp_driver.step if self.tp_driver else None)
        self._rng = random.Random(config.seed)
        self.vocab_size = self.model_config.vocab_size
        # Speculative decoding (None when off): drafts are proposed at the end of each step.
        self.spec = build_speculator(self)
        if self.spec is not None:
            self.scheduler.add_release_listener(self.spec.on_release)

    # -- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    params: SamplingParams, seed: int | None = None,
                    status: RequestStatus = RequestStatus.WAITING) -> Request:
        self.validate(prompt_token_ids, params)
        if seed is None:
            seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        req = Request(request_id, list(prompt_token_ids), params, seed, status=status)
        self.scheduler.add(req)
        return req

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        if len(prompt_token_ids) == 0:
            raise ValueError("prompt must not be empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt_token_ids)} tokens; the model's context "
                             f"is {self.max_model_len} (prompt must leave room for one token)")
        bad = [t for t in prompt_token_ids if not 0 <= int(t) < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids contains ids outside [0, {self.vocab_size}): "
                             f"{bad[:5]}")
        params.validate_for_model(self.vocab_size)

    def close(self) -> None:
        """Stop the follower ranks of a tensor-parallel engine (no-op otherwise)."""
        if self.tp_driver is not None:
            self.tp_driver.close()
        if getattr(self, "tiers", None) is not None:
            self.tiers.close()

    def abort(self, request_id: str) -> bool:
        return self.scheduler.finish(request_id, RequestStatus.FINISHED_ABORTED) is not None

    def finish_stopped(self, request_id: str) -> None:
        """End a request that an outer layer stopped (e.g. on a stop string)."""
        self.scheduler.finish(request_id, RequestStatus.FINISHED_STOPPED)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # -- one step ------------------------------------------------------------------------
    def step(self, layer_hook: LayerHook | None = None) -> list[StepOutput]:
        plan = self.scheduler.schedule()
        if plan.is_empty:
            if self.idle_tick() == 0 and self.scheduler.stalled_on_io:
                time.sleep(IO_STALL_WAIT_S)  # only SSD reads are pending: do not spin
            return []
        sampled, logprobs = self.execute(plan, layer_hook)
        return self.apply_results(plan, sampled, logprobs)

    def execute(self, plan: StepPlan, layer_hook: LayerHook | None = None,
                tp_extra: dict | None = None
                ) -> tuple[dict[str, list[int]], dict[str, list[TokenLogprobs | None]]]:
        """Forward + sampling for a plan: the accepted tokens of each sampling request."""
        t0 = time.perf_counter()
        logits = self.runner.logits(plan.chunks, layer_hook, tp_extra)
        if self.tiers is not None:  # prefill speed: the "recompute" side of load-or-recompute
            self.tiers.observe_forward(plan.chunks, logits, t0)
        rows, owners = self._sampling_rows(plan.chunks)
        if not rows:
            return {}, {}
        if self.spec is not None and any(c.spec_token_ids for c in plan.chunks):
            return self.spec.sample(self.runner.sampler, plan.chunks, logits, rows)
        out = self.runner.sample(logits, rows)
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list[TokenLogprobs | None]] = {}
        for rid, tok, lp in zip(owners, out.token_ids, out.logprobs, strict=True):
            sampled.setdefault(rid, []).append(tok)
            logprobs.setdefault(rid, []).append(lp)
        return sampled, logprobs

    def apply_results(self, plan: StepPlan, sampled: dict[str, list[int]],
                      logprobs: dict[str, list[TokenLogprobs | None]]) -> list[StepOutput]:
        reasons: dict[str, str] = {}
        for rid, tokens in sampled.items():
            req = self.scheduler.requests[rid]
            kept, reason = apply_stop_rules(req, tokens, self.eos_token_ids, self.max_model_len)
            sampled[rid] = kept
            if reason:
                reasons[rid] = reason
        touched = self.scheduler.update(plan, sampled)
        outputs = []
        for req in touched:
            rid = req.request_id
            new = sampled[rid]
            reason = reasons.get(rid)
            if reason:
                self.scheduler.finish(rid, RequestStatus(reason))
            outputs.append(StepOutput(
                rid, new, logprobs[rid][:len(new)], reason, req.num_prompt_tokens,
                max(req.num_cached_tokens, 0), len(req.output_token_ids)))
        if self.spec is not None:
            self.spec.propose(self.scheduler)  # drafts for the next step
        self.demote_ahead(DEMOTE_AHEAD_PER_STEP)  # every step path ends here
        return outputs

    # -- between steps -------------------------------------------------------------------
    def demote_ahead(self, max_blocks: int) -> int:
        """Copy up to `max_blocks` of the cached-free blocks next in line for eviction to the
        host tier, keeping them on the device; returns how many were copied (mutates the
        tiers; with TP the followers' copies travel with the next control message)."""
        if self.tiers is None or max_blocks <= 0:
            return 0
        window = self.tiers.ahead_window(self.config.kv_demote_ahead_blocks)
        if window == 0:
            return 0
        return len(self.tiers.demote_ahead(self.pool.eviction_candidates(window), max_blocks))

    def idle_tick(self) -> int:
        """Background work for a pause between steps: a larger ahead-demotion budget, sent to
        the followers at once. Returns the blocks copied (0: nothing left to do)."""
        n = self.demote_ahead(DEMOTE_AHEAD_WHEN_IDLE)
        if n and self.tp_driver is not None:
            self.tp_driver.flush_tier_ops()
        return n

    def _sampling_rows(self, chunks: Sequence[ScheduledChunk]
                       ) -> tuple[list[SamplingRow], list[str]]:
        rows: list[SamplingRow] = []
        owners: list[str] = []
        for c in chunks:
            if c.num_samples == 0:
                continue
            req = self.scheduler.requests[c.request_id]
            for j in range(c.num_samples):
                out = req.output_token_ids + c.spec_token_ids[:j]
                rows.append(SamplingRow(req.params, req.prompt_token_ids, out, req.seed,
                                        len(out), self.eos_token_ids))
                owners.append(c.request_id)
        return rows, owners

    # -- introspection -------------------------------------------------------------------
    @torch.inference_mode()
    def prompt_logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """fp32 logits at every position of a prompt (a standalone pass, cache untouched)."""
        blocks = self.pool.allocate(-(-len(token_ids) // self.config.block_size))
        if blocks is None:
            raise RuntimeError("not enough free KV blocks for prompt_logits")
        try:
            chunk = ScheduledChunk("prompt_logits", list(token_ids), 0, blocks, len(token_ids))
            return self.runner.logits([chunk])
        finally:
            self.pool.free(blocks)

    def stats(self) -> dict[str, float]:
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "queued_prefill_tokens": self.scheduler.num_queued_prefill_tokens,
            "kv_blocks_total": self.pool.num_blocks,
            "kv_blocks_used": self.pool.num_used,
            "kv_blocks_cached": self.pool.num_cached,
            **(self.spec.stats() if self.spec is not None else spec_stats_off()),
            **(self.tiers.stats() if self.tiers is not None else tier_stats_off()),
        }

    # -- setup ---------------------------------------------------------------------------
    def _kv_shape(self, model: torch.nn.Module, num_blocks: int) -> tuple[int, ...]:
        attn = model.layers[0].self_attn
        return (num_blocks, 2, attn.num_kv_heads, self.config.block_size,
                self.kv_dtype.last_dim(attn.head_dim))

    def _auto_num_blocks(self, model: torch.nn.Module) -> int:
        attn = model.layers[0].self_attn
        per_block = self.kv_dtype.bytes_per_block(attn.num_kv_heads, self.config.block_size,
                                                  attn.head_dim)
        per_block *= self.model_config.num_layers
        if self.config.kv_cache_memory_gb is not None:
            budget = self.config.kv_cache_memory_gb * 2**30
        elif self.device.type == "cuda":
            budget = 0.8 * torch.cuda.mem_get_info(self.device)[0]
        else:
            budget = 2**30
        return max(1, int(budget // per_block))

    def _build_tiers(self, caches: list[torch.Tensor], on_block_event):
        """Host / SSD tiers below the device cache (None when not configured). With TP every
        rank has its own (SSD in `<kv_ssd_dir>/rank<r>`); rank 0 mirrors its operations."""
        cfg = self.config
        ssd_dir = cfg.kv_ssd_dir
        if ssd_dir is not None and self.tp.size > 1:
            ssd_dir = os.path.join(ssd_dir, f"rank{self.tp.rank}")
        tiers = TierManager.create(caches, cfg.block_size, cfg.kv_host_gb, ssd_dir,
                                   cfg.kv_ssd_gb, on_event=on_block_event,
                                   ssd_persist=cfg.kv_ssd_persist)
        if tiers is not None and self.tp_driver is not None:
            from pdserve.engine.tp.tiers import MirroredTiers

            return MirroredTiers(tiers, self.tp_driver)
        return tiers

    def _allocate_caches(self, model: torch.nn.Module, num_blocks: int) -> list[torch.Tensor]:
        shape = self._kv_shape(model, num_blocks)
        return [torch.zeros(shape, dtype=self.kv_dtype.storage_dtype, device=self.device)
                for _ in range(self.model_config.num_layers)]

def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)

def _resolve_dtype(name: str, cfg: ModelConfig) -> torch.dtype:
    if name == "auto":
        try:
            return parse_dtype(cfg.torch_dtype)
        except ValueError:
            return torch.float32
    return parse_dtype(name)

def _eos_ids(model_dir: Path, cfg: ModelConfig) -> set[int]:
    ids = set(cfg.eos_token_ids)
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else ([] if eos is None else [eos]))
    return ids
