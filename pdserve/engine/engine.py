"""The engine loop: admit requests, schedule a step, run it, apply stop rules, report.

Used directly by the workers (token ids in, `StepOutput`s out) and wrapped by `LLM` for
offline use. A `layer_hook` passed to `step()` runs after each layer's KV is written.

Workers whose KV comes from another worker use the remote-KV methods (`reserve_remote`,
`activate_remote`, `fail_remote`; `reserve_pull`, `settle_pull`; see
`pdserve.engine.remote_kv`) and nothing else of the scheduler or the block pool. A request may
bring output it already generated elsewhere (`generated`, migration): it is prefilled with
its prompt and then continues at the right token index, so seeded sampling, penalties and
stop rules see exactly what an undisturbed run sees.
"""

from __future__ import annotations

import dataclasses
import os
import random
import time
from collections.abc import Sequence

import torch

from kv_store.block_pool import BlockPool
from kv_store.tiers.manager import TierManager, tier_stats_off
from pdserve.block_hash import hash_extra
from pdserve.engine import batch_invariant
from pdserve.engine.attention.backend import get_backend, resolve_backend_name
from pdserve.engine.checkpoint import Checkpoint, open_checkpoint
from pdserve.engine.config import EngineConfig, cpu_kv_cache_gb
from pdserve.engine.cuda_graphs import graph_args
from pdserve.engine.finish import FinishReason
from pdserve.engine.host_malloc import retain_freed_memory
from pdserve.engine.kv_layout import KVLayout
from pdserve.engine.kv_manager import KVCacheManager, cdiv
from pdserve.engine.loader import load_model
from pdserve.engine.model_config import ModelConfig, parse_dtype
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.models.llama import LayerHook
from pdserve.engine.outputs import StepOutput
from pdserve.engine.parallel import SINGLE, ParallelContext
from pdserve.engine.quant.checkpoint import resolve_quantization
from pdserve.engine.quant.kv_format import KVCacheFormat
from pdserve.engine.remote_kv import KVReservation, NoKVCapacity, PullReservation
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampler import SamplingRow, TokenLogprobs, apply_token_bitmask, score_tokens
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig, StepPlan
from pdserve.engine.spec import build_speculator, spec_stats_off
from pdserve.engine.spec.features import FeatureSpec, StepFeatures
from pdserve.engine.stop import apply_stop_rules, stop_reason
from pdserve.engine.structured.compiler import GrammarCompiler
from pdserve.engine.structured.manager import StructuredOutputs

# Blocks copied to the host tier ahead of eviction per step (busy) and per idle tick.
DEMOTE_AHEAD_PER_STEP = 2
DEMOTE_AHEAD_WHEN_IDLE = 16
# How long an engine with nothing to run but requests waiting for SSD reads pauses per step.
IO_STALL_WAIT_S = 0.001


class LLMEngine:
    def __init__(self, config: EngineConfig, tp: ParallelContext = SINGLE,
                 on_block_event=None, tp_role: str = "engine",
                 checkpoint: Checkpoint | None = None) -> None:
        """`checkpoint`: `config.model` already opened (LLM shares it with its tokenizer)."""
        self.config = config
        # Local: the checkpoint (a GGUF's memory map) is not kept once the weights are loaded.
        checkpoint = checkpoint or open_checkpoint(config.model)
        self.model_config = checkpoint.model_config
        self.model_id = config.model_id or checkpoint.model_id
        self.device = _resolve_device(config.device)
        self.malloc = (retain_freed_memory()
                       if self.device.type == "cpu" and config.host_malloc == "retain" else None)
        self.dtype = _resolve_dtype(config.dtype, self.model_config)
        self.max_model_len = config.max_model_len or min(
            self.model_config.max_position_embeddings, 32768)
        self.eos_token_ids = checkpoint.eos_token_ids
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
        int4_kernel = batch_invariant.INT4_KERNEL if config.batch_invariant else \
            config.int4_kernel
        try:
            if config.batch_invariant and self.device.type != "cpu":
                raise ValueError(f"batch_invariant=True runs on the CPU, not {self.device}")
            model = load_model(checkpoint, self.model_config, self.dtype, self.device, tp,
                               self.max_model_len, quantization=config.quantization,
                               lm_head_dtype=config.lm_head_dtype,
                               fp8_full_precision=config.fp8_full_precision_layers,
                               int4_kernel=int4_kernel)
            if config.batch_invariant:
                batch_invariant.check_model(model)
        except BaseException:
            self.close()
            raise
        self.kv_dtype = KVCacheFormat.from_config(config.kv_cache_dtype, self.dtype)
        # Everything that sizes, moves or hashes a KV block reads this one value.
        self.kv_layout = KVLayout.of_model(self.model_config, config.block_size, self.kv_dtype)
        num_blocks = config.num_gpu_blocks or self._auto_num_blocks()
        caches = self.kv_layout.new_caches(num_blocks, tp.size, self.device,
                                           prefault=config.kv_cache_prefault)
        if self.tp_driver is not None:
            self.tp_driver.setup(num_blocks)
        self.pool = BlockPool(num_blocks, config.block_size, config.enable_prefix_caching,
                              on_event=on_block_event)
        # The hash binds a block to everything that decides its bytes, weight quantisation too.
        scheme = resolve_quantization(config.quantization, checkpoint.path,
                                      config.fp8_full_precision_layers, int4_kernel,
                                      checkpoint.native_quantization())
        kv_key = f"{self.kv_layout.hash_key()}|w={scheme.key if scheme is not None else 'none'}"
        self.tiers = self._build_tiers(caches, on_block_event)
        if self.tiers is not None:
            self.pool.set_evict_listener(self.tiers.demote)
        kv = KVCacheManager(self.pool, hash_extra(self.model_id, kv_key, config.block_size),
                            tiers=self.tiers, copy_blocks=self._copy_blocks)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs, max_model_len=self.max_model_len), kv)
        self.runner = ModelRunner(model, caches, self._attention_backend(),
                                  config.block_size, self.device,
                                  self.tp_driver.step if self.tp_driver else None,
                                  compile_decode=config.compile_decode,
                                  graph_limits=graph_args(config.max_num_seqs,
                                                          self.max_model_len,
                                                          config.block_size))
        self._rng = random.Random(config.seed)
        self.vocab_size = self.model_config.vocab_size
        # Speculative decoding (None when off): drafts are proposed at the end of each step.
        self.spec = build_speculator(self)
        if self.spec is not None:
            self.scheduler.add_release_listener(self.spec.on_release)
        # Grammar matchers of constrained requests (xgrammar loads on the first one).
        self.structured = StructuredOutputs(self._grammar_compiler, self.vocab_size)
        self.scheduler.add_release_listener(self._on_release)
        self.scheduler.add_fork_listener(self.structured.prepare)  # each choice its own

    # -- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    params: SamplingParams, seed: int | None = None,
                    generated: Sequence[int] = (),
                    forks: Sequence[tuple[str, int]] = ()) -> Request:
        """Queue a request. `generated`: output it already produced elsewhere (a migrated
        request); it continues from there (check `continuation_finished` first). `forks`:
        (request id, seed) of more choices of the same prompt, forked from this one once its
        prompt is computed (they share its prompt KV; see `Scheduler.fork_ready`)."""
        req = self._new_request(request_id, prompt_token_ids, params, seed, generated, forks)
        self.scheduler.add(req)
        return req

    def _new_request(self, request_id: str, prompt_token_ids: Sequence[int],
                     params: SamplingParams, seed: int | None, generated: Sequence[int],
                     forks: Sequence[tuple[str, int]] = ()) -> Request:
        self.validate(prompt_token_ids, params, generated)
        ids = [request_id, *(child for child, _ in forks)]
        if len(set(ids)) != len(ids) or any(i in self.scheduler.requests for i in ids):
            raise ValueError(f"request ids {ids} are not unique or already in flight")
        if forks and generated:
            raise ValueError("a continuation (generated tokens) cannot fork choices")
        if seed is None:
            seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        req = Request(request_id, list(prompt_token_ids), params, seed,
                      output_token_ids=[int(t) for t in generated],
                      forks=[(str(c), int(s)) for c, s in forks])
        # A matcher for a constrained request (an invalid grammar is a ValueError, nothing
        # added); it catches up on `generated` (a migrated request's earlier output) lazily.
        self.structured.prepare(req)
        return req

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                 generated: Sequence[int] = ()) -> None:
        """Raise ValueError naming what is wrong (reads fixed limits only: any thread)."""
        if len(prompt_token_ids) == 0:
            raise ValueError("prompt must not be empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt_token_ids)} tokens; the model's context "
                             f"is {self.max_model_len} (prompt must leave room for one token)")
        for name, ids in (("prompt_token_ids", prompt_token_ids), ("generated", generated)):
            bad = [t for t in ids if not 0 <= int(t) < self.vocab_size]
            if bad:
                raise ValueError(f"{name} contains ids outside [0, {self.vocab_size}): "
                                 f"{bad[:5]}")
        params.validate_for_model(self.vocab_size)

    def compile_grammar(self, params: SamplingParams) -> None:
        """Compile (and cache) a constrained request's grammar; callable from any thread.
        Workers call it on a thread pool before adding the request, so the engine thread
        never waits for a compile. Raises ValueError (InvalidConstraint) for a bad spec."""
        if params.structured is not None:
            self.structured.compiler.compile(params.structured)

    def continuation_finished(self, num_prompt_tokens: int, params: SamplingParams,
                              generated: Sequence[int]) -> FinishReason | None:
        """Whether output already generated elsewhere ends the request by itself (its last
        token stops it, or it is at its length limit): then there is nothing to continue."""
        return stop_reason(params, num_prompt_tokens, generated, self.eos_token_ids,
                           self.max_model_len)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.scheduler.requests

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        """The paged KV cache, one tensor per layer (shape: `kv_layout.cache_shape`): what a
        transfer writes into reserved blocks and reads out of pinned ones."""
        return self.runner.caches

    @property
    def hash_extra(self) -> bytes:
        """The block hash's `extra` (model, KV layout, block size): equal on two engines
        exactly when their KV blocks are interchangeable."""
        return self.scheduler.kv.hash_extra

    # -- requests whose KV arrives from elsewhere (pdserve.engine.remote_kv) -----------------
    def reserve_remote(self, request_id: str, prompt_token_ids: Sequence[int],
                       params: SamplingParams, seed: int,
                       forks: Sequence[tuple[str, int]] = ()) -> KVReservation:
        """Admit a request whose prompt a prefill worker computes: WAITING_FOR_KV, its prefix
        hit taken and blocks held for the whole prompt; `forks` (see `add_request`) fork from
        it when its KV has landed. Raises ValueError (bad request) or `NoKVCapacity`."""
        req = self._new_request(request_id, prompt_token_ids, params, seed, (), forks)
        res = self.scheduler.reserve_remote(req)
        if res is None:
            self.structured.release(request_id)
            raise NoKVCapacity(f"{self.pool.num_free} free KV blocks; the prompt needs "
                               f"{cdiv(req.num_tokens, self.config.block_size)}")
        return res

    def activate_remote(self, request_id: str, first_token: int) -> StepOutput | None:
        """All of a reserved request's KV landed: it runs with the prefill worker's first
        token as its first output, stop rules applied to it. Returns its last output if that
        token ended it (the token itself reached the client through the prefill worker), else
        None; None as well when the request no longer waits (cancelled meanwhile)."""
        req = self.scheduler.waiting_for_kv(request_id)
        if req is None:
            return None
        _, reason = apply_stop_rules(req.params, req.num_prompt_tokens, 0, [first_token],
                                     self.eos_token_ids, self.max_model_len)
        self.scheduler.activate(request_id, first_token, reason)
        if reason is None:
            return None
        return StepOutput(request_id, [], [], reason, req.num_prompt_tokens,
                          max(req.num_cached_tokens, 0), len(req.output_token_ids))

    def fail_remote(self, request_id: str) -> StepOutput | None:
        """The KV hand-off of a request failed: it ends ABORTED, its blocks are freed.
        Returns its last output, or None if it had ended already."""
        req = self.scheduler.finish(request_id, RequestStatus.FINISHED_ABORTED)
        if req is None:
            return None
        return StepOutput(request_id, [], [], FinishReason.ABORT, req.num_prompt_tokens, 0,
                          len(req.output_token_ids))

    def reserve_pull(self, request_id: str, prompt_token_ids: Sequence[int],
                     params: SamplingParams, seed: int, source_blocks: int,
                     generated: Sequence[int] = ()) -> PullReservation | None:
        """Add a request and, if another worker holding `source_blocks` leading blocks of it
        has more than this engine, reserve blocks to pull them into (PULLING). None: nothing
        to pull, the request is queued as usual. Raises ValueError for a bad request."""
        req = self._new_request(request_id, prompt_token_ids, params, seed, generated)
        return self.scheduler.reserve_pull(req, source_blocks)

    def pin_leading(self, token_ids: Sequence[int], start: int, end: int) -> list[int]:
        """The pushing side of a pull: pin the run of blocks [start, end) of `token_ids` this
        engine holds (hash and token ids checked; host/SSD blocks loaded), stopping at the
        first miss; their KV can be read outside a step until `unpin`."""
        return self.scheduler.kv.pin_leading(token_ids, start, end)

    def unpin(self, block_ids: Sequence[int]) -> None:
        self.scheduler.kv.unpin(block_ids)

    def settle_pull(self, request_id: str, landed: int) -> int:
        """End a pull with `landed` leading blocks of its range in place (0: it failed): they
        join the prefix cache, the others are freed, the request is queued and computes the
        rest. The transfer must be stopped first: freed blocks are reused at once."""
        return self.scheduler.settle_pull(request_id, landed)

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
    def plan(self) -> StepPlan:
        """The next step's plan (for a caller that runs `execute` and `apply_results` itself,
        e.g. with a layer hook built from the plan)."""
        return self.scheduler.schedule()

    @property
    def stalled_on_io(self) -> bool:
        """The last plan was empty only because waiting requests wait for their SSD reads."""
        return self.scheduler.stalled_on_io

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
        wants = self.spec.feature_spec if self.spec is not None else None
        forward = self.runner.forward(plan.chunks, layer_hook, tp_extra, wants)
        logits = forward.logits
        if forward.features is not None:  # a learned drafter reads them once it is applied
            self.spec.observe(plan.chunks, forward.features)
        if self.tiers is not None:  # prefill speed: the "recompute" side of load-or-recompute
            self.tiers.observe_forward(plan.chunks, logits, t0)
        if forward.prompt_logits is not None:
            self._score_prompts(plan.chunks, forward.prompt_logits)
        rows, owners = self._sampling_rows(plan.chunks)
        if not rows:
            return {}, {}
        masks = self.structured.bitmask(plan.chunks, self.scheduler.requests)
        if masks is not None:  # before sampling and verification alike
            apply_token_bitmask(logits, *masks)
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
        reasons: dict[str, FinishReason] = {}
        for rid, tokens in sampled.items():
            req = self.scheduler.requests[rid]
            kept, reason = apply_stop_rules(req.params, req.num_prompt_tokens,
                                            len(req.output_token_ids), tokens,
                                            self.eos_token_ids, self.max_model_len)
            kept, reason = self._grammar_rules(req, kept, reason)
            sampled[rid] = kept
            if reason:
                reasons[rid] = reason
        touched = self.scheduler.update(plan, sampled)
        outputs = []
        for req in touched:
            rid = req.request_id
            new = sampled[rid]
            reason = reasons.pop(rid, None)
            if reason:
                self.scheduler.finish(rid, RequestStatus.finished(reason))
            first = len(req.output_token_ids) == len(new)
            outputs.append(StepOutput(
                rid, new, logprobs[rid][:len(new)], reason, req.num_prompt_tokens,
                max(req.num_cached_tokens, 0), len(req.output_token_ids),
                list(req.prompt_logprobs) if first and req.params.prompt_logprobs is not None
                else None))
        for rid, reason in reasons.items():  # ended without a token (a grammar refused it)
            req = self.scheduler.finish(rid, RequestStatus.finished(reason))
            if req is not None:
                outputs.append(StepOutput(rid, [], [], reason, req.num_prompt_tokens,
                                          max(req.num_cached_tokens, 0),
                                          len(req.output_token_ids)))
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

    def _grammar_rules(self, req: Request, kept: list[int], reason: FinishReason | None
                       ) -> tuple[list[int], FinishReason | None]:
        """Cut a constrained request's tokens where its grammar ends (finish "stop") or
        refuses a token ("abort")."""
        adv = self.structured.advance(req, kept)
        if adv.reason is None:
            return kept, reason
        if adv.keep < len(kept) or reason is None or adv.reason is FinishReason.ABORT:
            return kept[:adv.keep], adv.reason
        return kept, reason

    def _score_prompts(self, chunks: Sequence[ScheduledChunk], logits: torch.Tensor) -> None:
        """Prompt logprobs of the positions each chunk scored, appended to its request."""
        at = 0
        for c in chunks:
            n = c.num_prompt_logits
            if n == 0:
                continue
            rows, at = logits[at:at + n], at + n
            req = self.scheduler.requests.get(c.request_id)
            if req is None or req.params.prompt_logprobs is None:
                continue
            skip = len(req.prompt_logprobs) - c.start  # scored before a preemption
            if skip < 0:
                continue  # cannot happen without a prefix hit, which such requests skip
            targets = req.prompt_token_ids[c.start + 1 + skip:c.start + 1 + n]
            req.prompt_logprobs.extend(score_tokens(rows[skip:], targets,
                                                    req.params.prompt_logprobs))

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """KV of device blocks src -> dst on every rank (a fork's copy-on-write)."""
        self.runner.copy_blocks(pairs)
        if self.tp_driver is not None:
            self.tp_driver.call({"op": "copy_blocks", "pairs": [list(p) for p in pairs]})

    def _on_release(self, req: Request) -> None:
        if req.status is not RequestStatus.WAITING:  # preempted requests keep their matcher
            self.structured.release(req.request_id)

    def _grammar_compiler(self) -> GrammarCompiler:
        # Reopened on first use: the engine keeps no checkpoint (a GGUF's memory map).
        return GrammarCompiler(open_checkpoint(self.config.model).tokenizer(), self.vocab_size,
                               self.eos_token_ids)

    def _sampling_rows(self, chunks: Sequence[ScheduledChunk]
                       ) -> tuple[list[SamplingRow], list[str]]:
        rows: list[SamplingRow] = []
        owners: list[str] = []
        for c in chunks:
            if c.num_samples == 0:
                continue
            req = self.scheduler.requests[c.request_id]
            for j in range(c.num_samples):
                # Read only during this step: the plain row shares the request's list.
                out = (req.output_token_ids if j == 0
                       else req.output_token_ids + c.spec_token_ids[:j])
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

    @torch.inference_mode()
    def prompt_features(self, token_ids: Sequence[int], spec: FeatureSpec | None = None
                        ) -> StepFeatures:
        """Target features (what a learned drafter reads) at every position of a sequence:
        a standalone pass like `prompt_logits` (training data for draft heads)."""
        blocks = self.pool.allocate(-(-len(token_ids) // self.config.block_size))
        if blocks is None:
            raise RuntimeError("not enough free KV blocks for prompt_features")
        try:
            chunk = ScheduledChunk("prompt_features", list(token_ids), 0, blocks, 0)
            return self.runner.forward([chunk], features=spec or FeatureSpec()).features
        finally:
            self.pool.free(blocks)

    def stats(self) -> dict[str, float]:
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_waiting_for_kv": self.scheduler.num_waiting_for_kv,
            "queued_prefill_tokens": self.scheduler.num_queued_prefill_tokens,
            "kv_blocks_total": self.pool.num_blocks,
            "kv_blocks_used": self.pool.num_used,
            "kv_blocks_cached": self.pool.num_cached,
            "prefix_cache_queries": self.scheduler.prefix_cache_queries,
            "prefix_cache_hits": self.scheduler.prefix_cache_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            **(self.spec.stats() if self.spec is not None else spec_stats_off()),
            **(self.tiers.stats() if self.tiers is not None else tier_stats_off()),
        }

    # -- setup ---------------------------------------------------------------------------
    def _attention_backend(self):
        if not self.config.batch_invariant:
            return get_backend(self.config.attention_backend, self.device)
        if resolve_backend_name(self.config.attention_backend, self.device) != "cpu":
            raise ValueError("batch_invariant=True needs the C++ CPU attention kernels, which "
                             "did not build here (see the warning)")
        from pdserve.engine.attention.cpu_backend import CpuPagedAttention

        return CpuPagedAttention(every_row=True)

    def _auto_num_blocks(self) -> int:
        per_block = self.kv_layout.block_bytes(self.tp.size)
        if self.config.kv_cache_memory_gb is not None:
            budget = self.config.kv_cache_memory_gb * 2**30
        elif self.device.type == "cuda":
            budget = 0.8 * torch.cuda.mem_get_info(self.device)[0]
        else:
            budget = cpu_kv_cache_gb() * 2**30
        return max(1, int(budget // per_block))

    def _build_tiers(self, caches: list[torch.Tensor], on_block_event):
        """Host / SSD tiers below the device cache (None when not configured). With TP every
        rank has its own (SSD in `<kv_ssd_dir>/rank<r>`); rank 0 mirrors its operations."""
        cfg = self.config
        ssd_dir = cfg.kv_ssd_dir
        if ssd_dir is not None and self.tp.size > 1:
            ssd_dir = os.path.join(ssd_dir, f"rank{self.tp.rank}")
        tiers = TierManager.create(caches, self.kv_layout, self.tp.size, cfg.kv_host_gb, ssd_dir,
                                   cfg.kv_ssd_gb, on_event=on_block_event,
                                   ssd_persist=cfg.kv_ssd_persist)
        if tiers is not None and self.tp_driver is not None:
            from pdserve.engine.tp.tiers import MirroredTiers

            return MirroredTiers(tiers, self.tp_driver)
        return tiers


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
