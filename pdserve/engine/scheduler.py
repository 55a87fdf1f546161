"""Continuous-batching scheduler: pure Python, no tensors.

Each step `schedule()` returns a `StepPlan`: which requests run, how many tokens of each (a
prefill chunk, one decode token, or a decode token plus speculative tokens), under a per-step
token budget. The runner executes the plan; `update()` takes the sampled tokens back.

Policy, in order:
1. Running requests first, FCFS; each gets what it still needs (capped by the budget and the
   long-prefill chunk size). When blocks run out, the most recently admitted running request is
   preempted: its blocks are released and it goes back to the head of the waiting queue, to be
   recomputed (its cached full blocks usually make that cheap).
2. Then waiting requests, FCFS, while budget, sequence slots and blocks last; none overtakes
   another for blocks. A prefix-cache hit is taken at admission. The one exception: a request
   whose prefix is being read from SSD (`KVCacheManager.prefix_ready`) stays in place while
   the requests behind it go ahead, so it waits only for its own blocks.

Requests whose KV arrives from another worker wait outside both queues, in WAITING_FOR_KV
(reserved for a remote prefill) or PULLING (a prefix being copied in); the scheduler owns
those states too (`reserve_remote` / `activate`, `reserve_pull` / `settle_pull`; the
lifecycle is drawn in `pdserve.engine.remote_kv`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from pdserve.engine.finish import FinishReason
from pdserve.engine.kv_manager import KVCacheManager
from pdserve.engine.remote_kv import KVReservation, PullReservation
from pdserve.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 1024
    """Token budget of one step (prefill chunk tokens + decode tokens)."""
    max_num_seqs: int = 128
    """Most requests running at once."""
    max_model_len: int = 4096
    """Longest sequence (prompt + output) a request may reach."""
    long_prefill_chunk: int = 0
    """Cap on one request's prefill chunk per step (0 = the whole budget)."""


@dataclass(frozen=True)
class ScheduledChunk:
    """One request's share of a step.

    The runner computes tokens [start, start + len(token_ids)) of the request (KV written into
    `block_ids`), and samples `num_samples` tokens if that count is > 0: one after the chunk for
    a normal step, or 1 + len(spec_token_ids) when the tail of the chunk is speculative.
    """

    request_id: str
    token_ids: list[int]
    start: int
    block_ids: list[int]
    num_samples: int
    spec_token_ids: list[int] = field(default_factory=list)
    num_prompt_logits: int = 0
    """Prompt scoring (`prompt_logprobs`): the logits of this many leading positions of the
    chunk are wanted too (position p scores prompt token p + 1)."""


@dataclass(frozen=True)
class StepPlan:
    chunks: list[ScheduledChunk]
    preempted: list[str]
    num_tokens: int

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        # The last plan was empty only because waiting requests wait for their SSD reads.
        self.stalled_on_io = False
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.pulls: dict[str, PullReservation] = {}  # of the PULLING requests
        self._release_listeners: list[Callable[[Request], None]] = []
        self._fork_listeners: list[Callable[[Request], None]] = []
        # Cumulative counts for metrics: prompt tokens looked up in / found in the prefix
        # cache at first admission, and preemptions.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_preemptions = 0

    def add_release_listener(self, fn: Callable[[Request], None]) -> None:
        """Call `fn(req)` whenever a request gives its blocks back: finished (any reason) or
        preempted (`req.status` is then WAITING). Lets a drafter drop its per-request state."""
        self._release_listeners.append(fn)

    # -- queue management ----------------------------------------------------------------
    def add_fork_listener(self, fn: Callable[[Request], None]) -> None:
        """Call `fn(child)` for each choice forked from a request (`fork_ready`)."""
        self._fork_listeners.append(fn)

    def fork_ready(self, parent: Request) -> list[Request]:
        """`parent`'s prompt KV is in: fork its pending choices (`Request.forks`). Each child
        is RUNNING at once with the parent's prompt KV but the last token's (shared full
        blocks, a copy of the partial one: `KVCacheManager.fork`), so its first step computes
        that token and samples its own first output with its own seed. A child that cannot
        get its copy queues as a new request instead (its prefix hit then covers the blocks
        the parent published). Forks join the running set beyond `max_num_seqs` if need be:
        their parent's batch already holds their prompt."""
        forks, parent.forks = parent.forks, []
        children = []
        for child_id, seed in forks:
            child = Request(child_id, list(parent.prompt_token_ids), parent.params, seed)
            self._register(child)
            child.num_cached_tokens = max(parent.num_cached_tokens, 0)
            if self.kv.fork(parent, child):
                child.status = RequestStatus.RUNNING
                self.running.append(child)
            else:
                child.status = RequestStatus.WAITING
                self.waiting.append(child)
            for fn in self._fork_listeners:
                fn(child)
            children.append(child)
        return children

    def add(self, req: Request) -> None:
        """Queue a new request (WAITING) for admission."""
        self._register(req)
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request for any reason, in any state, and release its blocks. Idempotent."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.pulls.pop(request_id, None)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        self.kv.release(req)
        for fn in self._release_listeners:
            fn(req)
        return req

    def _register(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in flight")
        self.requests[req.request_id] = req

    # -- requests whose KV arrives from elsewhere ------------------------------------------
    def reserve_remote(self, req: Request) -> KVReservation | None:
        """Admit a new request as WAITING_FOR_KV: take its prefix hit and hold blocks for its
        whole prompt. None (and the request not added) when the blocks are not free."""
        self._register(req)
        req.status = RequestStatus.WAITING_FOR_KV
        hits = self.kv.match_prefix(req)
        if not self.kv.admit(req, hits, req.num_tokens - len(hits) * self.kv.block_size):
            del self.requests[req.request_id]
            return None
        req.num_cached_tokens = req.num_computed_tokens
        return KVReservation(req.request_id, tuple(req.block_ids), len(hits))

    def waiting_for_kv(self, request_id: str) -> Request | None:
        """The request, if it is WAITING_FOR_KV (read it, do not change it)."""
        req = self.requests.get(request_id)
        return req if req is not None and req.status is RequestStatus.WAITING_FOR_KV else None

    def activate(self, request_id: str, first_token: int,
                 reason: FinishReason | None) -> Request | None:
        """Every part of a WAITING_FOR_KV request's prompt KV landed: the prompt counts as
        computed (its blocks are published) and `first_token` (the prefill worker's) is its
        first output. It runs, or ends at once if `reason` says that token ended it. None if
        the request is not waiting for KV (cancelled meanwhile)."""
        req = self.waiting_for_kv(request_id)
        if req is None:
            return None
        req.num_computed_tokens = req.num_tokens
        req.output_token_ids.append(first_token)
        self.kv.publish(req)
        if req.forks:  # before a first token that ends the parent frees its blocks
            self.fork_ready(req)
        if reason is not None:
            self.finish(request_id, RequestStatus.finished(reason))
        else:
            req.status = RequestStatus.RUNNING
            self.running.append(req)
        return req

    def reserve_pull(self, req: Request, source_blocks: int) -> PullReservation | None:
        """Add a new request whose leading blocks another worker holds (`source_blocks` of
        them): PULLING, with its own prefix pinned and fresh blocks for the rest of the
        source's. None when there is nothing to pull: the request is then simply WAITING."""
        self._register(req)
        got = self.kv.reserve_pull(req, source_blocks)
        if got is None:
            req.status = RequestStatus.WAITING
            self.waiting.append(req)
            return None
        start, fresh = got
        req.status = RequestStatus.PULLING
        res = self.pulls[req.request_id] = PullReservation(
            req.request_id, tuple(req.all_token_ids), start, tuple(fresh))
        return res

    def settle_pull(self, request_id: str, landed: int) -> int:
        """A PULLING request's pull is over with `landed` leading blocks of it in place:
        those are published, the others freed, and the request queues for admission (WAITING;
        its prefix hit then covers what landed). Returns the blocks kept; 0 if the request is
        not pulling (cancelled meanwhile). Nothing may write the freed blocks any more."""
        res = self.pulls.pop(request_id, None)
        req = self.requests.get(request_id)
        if res is None or req is None:
            return 0
        kept = self.kv.settle_pull(req, res.start_block, landed)
        req.status = RequestStatus.WAITING
        self.waiting.append(req)
        return kept

    @property
    def num_waiting_for_kv(self) -> int:
        """Requests in WAITING_FOR_KV or PULLING (in neither queue)."""
        return len(self.requests) - len(self.waiting) - len(self.running)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_queued_prefill_tokens(self) -> int:
        return sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)

    # -- one step ------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        self.stalled_on_io = False
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        scheduled: set[str] = set()
        for req in list(self.running):
            if budget <= 0:
                break
            if req.request_id in preempted:
                continue
            n = self._num_new_tokens(req, budget)
            while not self.kv.grow(req, n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.request_id in preempted:
                continue
            chunks.append(self._chunk(req, n))
            scheduled.add(req.request_id)
            budget -= n
        if not preempted:
            budget = self._admit_waiting(budget, chunks)
        total = self.config.max_num_batched_tokens - budget
        return StepPlan(chunks=chunks, preempted=preempted, num_tokens=total)

    def _admit_waiting(self, budget: int, chunks: list[ScheduledChunk]) -> int:
        staging: list[Request] = []  # waiting for their own SSD reads: keep their places
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if not self.kv.prefix_ready(req):
                staging.append(self.waiting.popleft())
                continue
            hits = self.kv.match_prefix(req)
            remaining = req.num_tokens - len(hits) * self.kv.block_size
            n = self._cap(remaining, budget)
            if not self.kv.admit(req, hits, n):
                break
            self.waiting.popleft()
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = req.num_computed_tokens
                self.prefix_cache_queries += req.num_prompt_tokens
                self.prefix_cache_hits += req.num_computed_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            chunks.append(self._chunk(req, n))
            budget -= n
        self.waiting.extendleft(reversed(staging))
        self.stalled_on_io = bool(staging) and not chunks
        return budget

    def _num_new_tokens(self, req: Request, budget: int) -> int:
        remaining = req.num_tokens - req.num_computed_tokens
        if remaining == 1 and req.spec_token_ids:
            # A decode step that also verifies speculative tokens; they are all-or-nothing.
            want = 1 + len(req.spec_token_ids)
            if want <= budget:
                return want
            req.spec_token_ids = []
        return self._cap(remaining, budget)

    def _cap(self, remaining: int, budget: int) -> int:
        n = min(remaining, budget)
        if self.config.long_prefill_chunk > 0:
            n = min(n, self.config.long_prefill_chunk)
        return n

    def _chunk(self, req: Request, n: int) -> ScheduledChunk:
        start = req.num_computed_tokens
        known = req.num_tokens - start
        spec = req.spec_token_ids if n > known else []
        tokens = req.token_slice(start, start + min(n, known)) + spec
        done = start + n >= req.num_tokens
        return ScheduledChunk(
            request_id=req.request_id,
            token_ids=tokens,
            start=start,
            block_ids=list(req.block_ids),
            num_samples=(1 + len(spec)) if done else 0,
            spec_token_ids=list(spec),
            num_prompt_logits=_prompt_logits_wanted(req, start, n),
        )

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.release(req)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.tier_wait = None  # its blocks may have moved down meanwhile: stage again
        self.waiting.appendleft(req)
        for fn in self._release_listeners:
            fn(req)

    # -- results -------------------------------------------------------------------------
    def update(
        self, plan: StepPlan, sampled: dict[str, Sequence[int]]
    ) -> list[Request]:
        """Advance each scheduled request; append its accepted tokens. Returns requests that
        received tokens. `sampled[rid]` is the accepted tokens (1 + accepted spec tokens)."""
        touched: list[Request] = []
        for chunk in plan.chunks:
            req = self.requests.get(chunk.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue
            computed = len(chunk.token_ids) - len(chunk.spec_token_ids)
            tokens = sampled.get(req.request_id, ())
            # Accepted speculative tokens had their KV computed in this step as well.
            req.num_computed_tokens = chunk.start + computed + max(0, len(tokens) - 1)
            req.spec_token_ids = []
            if tokens:
                req.output_token_ids.extend(tokens)
                touched.append(req)
            self.kv.publish(req)
            if req.forks and req.num_computed_tokens >= req.num_prompt_tokens:
                self.fork_ready(req)
            if chunk.spec_token_ids:
                self.kv.trim(req, req.num_computed_tokens + 1)
        return touched

    def iter_running(self) -> Iterable[Request]:
        return iter(self.running)


def _prompt_logits_wanted(req: Request, start: int, n: int) -> int:
    """Leading positions of chunk [start, start + n) whose logits score a prompt token not yet
    scored: positions len(req.prompt_logprobs) .. num_prompt_tokens - 2 (the last prompt
    position predicts the first output token, which the sampler handles)."""
    if req.params.prompt_logprobs is None:
        return 0
    first = max(start, len(req.prompt_logprobs))
    end = min(start + n, req.num_prompt_tokens - 1)
    return max(0, end - start) if first < end else 0
