"""What every public API shares once a request is validated: admission, run the flow, turn
tokens into text (stop strings included), account usage. gRPC (`service.py`) and OpenAI HTTP
map these typed chunks onto their own wire formats.

    generate(req) ─► accepting? (else UNAVAILABLE: shutting down)
                  ─► admission.decide(pool loads, request size, deadline)
                       refused ─► Overloaded(RESOURCE_EXHAUSTED, retry_after_s), nothing sent
                  ─► flow.run(..., decode workers admission allows) ─► chunks

The admission inputs are the pools' stats and this router's own counts, read and updated with
no await in between (the flow takes its decode worker before its first await), so a burst of
requests sees each other's effect.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from pdserve.observability.router_metrics import RouterMetrics, status_of
from pdserve.proto import pb
from pdserve.text_stream import TextStream
from pdserve.tokenizer import Tokenizer
from router import admission, policy
from router.config import RouterConfig
from router.flow import FinishEvent, Flow, FlowError, FlowTimings, TokenEvent
from router.pool import WorkerHandle, WorkerPool
from router.tokenize import TokenizerPool
from router.validation import RequestLimits, ValidRequest

log = logging.getLogger("router.requests")


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class OutputChunk:
    """New tokens and text; `finish_reason` and `usage` are set on the last chunk only."""

    token_ids: list[int]
    text: str
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None


class Overloaded(FlowError):
    """Refused by admission control: RESOURCE_EXHAUSTED, retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
        self.retry_after_s = retry_after_s


class Frontend:
    def __init__(self, config: RouterConfig, tokenizer: Tokenizer, prefill: WorkerPool,
                 decode: WorkerPool, metrics: RouterMetrics | None = None,
                 limits: RequestLimits | None = None) -> None:
        self.config = config
        self.metrics = metrics if metrics is not None else RouterMetrics()
        self.tokenizer = tokenizer
        self.tokens = TokenizerPool(tokenizer)
        self.limits = limits if limits is not None else RequestLimits(
            32768, tokenizer.vocab_size, tokenizer.max_token_bytes)
        self.prefill, self.decode = prefill, decode
        self.flow = Flow(prefill, decode, config.local_prefill_tokens,
                         random.Random(uuid.uuid4().int), config.routing)
        counters = self.flow.counters  # the dict the flow increments in place
        self.metrics.export_flow_counters(lambda: counters)
        self.inflight = 0
        self.accepting = True  # False once shutting down: new requests get UNAVAILABLE
        self._remaining: dict[str, int] = {}  # output tokens each request may still produce
        self._remaining_sum = 0
        # Prompt tokens of admitted requests sent to prefill workers and not prefilled yet
        # (no first token): the prefill queue the workers' stats do not show yet.
        self._prefilling: dict[str, int] = {}
        self.slowdown = admission.Slowdown()  # streams' time per token vs the step models
        self._last_token: dict[str, tuple[float, int]] = {}  # (when, events so far)

    async def generate(self, req: ValidRequest, timeout_s: float | None
                       ) -> AsyncIterator[OutputChunk]:
        """Stream one request's output; raises `FlowError` with the status to return
        (`Overloaded` when admission refuses it, before anything is sent)."""
        rid = f"{req.request_id or 'req'}-{uuid.uuid4().hex[:12]}"  # unique on the workers
        timeout = self.config.default_timeout_s if timeout_s is None else timeout_s
        if not self.accepting:
            raise FlowError(grpc.StatusCode.UNAVAILABLE, "router is shutting down")
        p = req.params
        text = TextStream(self.tokenizer, req.prompt_token_ids, p.stop,
                          p.include_stop_str_in_output)
        want_lp = p.logprobs is not None
        n_prompt, sent = len(req.prompt_token_ids), 0
        # The workers know the request by `rid`; its prefix is the client's id, when given.
        trace = self.metrics.trace(rid, n_prompt, log)
        self.inflight += 1
        max_out = self._max_out(req)
        try:
            allowed = self._admit(req, max_out, timeout, rid)
            self._track(rid, max_out)
            async for ev in self.flow.run(rid, req, timeout, FlowTimings(),
                                          decode_allowed=allowed):
                if isinstance(ev, TokenEvent):
                    self._prefilling.pop(rid, None)
                    self._observe_itl(rid, len(ev.token_ids))
                    self._track(rid, -len(ev.token_ids))
                    sent += len(ev.token_ids)
                    trace.on_tokens(len(ev.token_ids))
                    delta = text.add(ev.token_ids)
                    yield OutputChunk(ev.token_ids, delta.text, ev.logprobs if want_lp else [])
                    if delta.stopped:
                        trace.finish("OK")  # before the yield: the caller may stop reading
                        yield OutputChunk([], "", [], "stop", Usage(n_prompt, sent, 0))
                        return
                elif isinstance(ev, FinishEvent):
                    trace.finish("OK", ev.cached_tokens)
                    yield OutputChunk([], text.finish().text, [], ev.reason,
                                      Usage(n_prompt, sent, ev.cached_tokens))
                    return
            trace.finish("INTERNAL")  # the flow always ends with a finish event or an error
        except BaseException as exc:
            trace.finish(status_of(exc))
            raise
        finally:
            self.inflight -= 1
            self._track(rid, None)
            self._prefilling.pop(rid, None)
            self._last_token.pop(rid, None)

    # -- admission -------------------------------------------------------------------------
    def _max_out(self, req: ValidRequest) -> int:
        room = self.limits.max_model_len - len(req.prompt_token_ids)
        return max(min(req.params.max_tokens, room), 1)

    def _admit(self, req: ValidRequest, max_out: int, timeout_s: float, rid: str
               ) -> frozenset[str] | None:
        """The decode workers that may take the request; `Overloaded` if none may. None when
        there is none at all: the flow answers that (UNAVAILABLE, retryable)."""
        healthy = self.decode.healthy()
        if not healthy:
            return None
        n_prompt = len(req.prompt_token_ids)
        remote = policy.prefill_remotely(n_prompt, 0, self.config.local_prefill_tokens,
                                         bool(self.prefill.healthy()))
        size = admission.RequestSize(n_prompt, max_out, timeout_s, remote)
        mean = self._remaining_sum / len(self._remaining) if self._remaining else max_out
        loads = [_decode_load(i, w, mean, self.slowdown) for i, w in enumerate(healthy)]
        prefill = self.prefill.healthy()
        pending = sum(self._prefilling.values()) / max(len(prefill), 1)  # the flow spreads it
        pre = [_prefill_load(w, pending, self.slowdown) for w in prefill]
        verdict = admission.decide(loads, pre, size, self.config.admission)
        if not verdict.admitted:
            raise Overloaded(f"over capacity: {verdict.reason}", verdict.retry_after_s)
        if remote:
            self._prefilling[rid] = n_prompt
        return frozenset(healthy[i].address for i in verdict.workers)

    def _observe_itl(self, rid: str, tokens: int) -> None:
        """Time per token this stream saw since its previous tokens, against the decode
        pool's step models. Not before its third event: the gap after the first token holds
        the KV transfer and the wait for a batch slot, not decode steps."""
        now = time.monotonic()
        last, events = self._last_token.get(rid, (0.0, 0))
        self._last_token[rid] = (now, events + 1)
        if events < 2 or tokens < 1:
            return
        predicted = [m.seconds(min(max(occ, 1), seqs or occ or 1))
                     for m, occ, seqs in self._decode_models()]
        if predicted:
            self.slowdown.observe((now - last) / tokens, sum(predicted) / len(predicted))
            self.metrics.admission_slowdown.set(self.slowdown.factor)

    def _decode_models(self):
        for w in self.decode.healthy():
            step = _step(w.stats)
            if step is not None:
                occ = max(int(w.stats.num_running + w.stats.num_waiting), w.inflight)
                yield step, occ, w.info.max_num_seqs if w.info is not None else 0

    def _track(self, rid: str, delta: int | None) -> None:
        """The ledger of output tokens each request may still produce (None: it ended)."""
        old = self._remaining.get(rid)
        if delta is None:
            if old is not None:
                self._remaining_sum -= old
                del self._remaining[rid]
            return
        new = max((old or 0) + delta, 0)
        self._remaining[rid] = new
        self._remaining_sum += new - (old or 0)


def _step(stats) -> admission.StepTime | None:
    m = stats.step_model
    return admission.StepTime(m.step_base_s, m.step_per_token_s) if m.samples else None


def _decode_load(i: int, w: WorkerHandle, mean_remaining: float,
                 slowdown: admission.Slowdown) -> admission.DecodeLoad:
    s, info = w.stats, w.info
    return admission.DecodeLoad(
        index=i, max_seqs=info.max_num_seqs if info is not None else 0,
        kv_blocks_total=int(s.kv_blocks_total),
        block_size=(info.block_size if info is not None else 0) or 16,
        occupancy=max(int(s.num_running + s.num_waiting), w.inflight),
        mean_remaining=mean_remaining, step=slowdown.scale(_step(s)))


def _prefill_load(w: WorkerHandle, pending_tokens: float,
                  slowdown: admission.Slowdown) -> admission.PrefillLoad:
    """`pending_tokens`: this worker's share of what the router admitted and has not seen
    prefilled (its stats lag by up to a poll period)."""
    s, info = w.stats, w.info
    queued = max(int(s.queued_prefill_tokens), int(pending_tokens))
    budget = info.max_num_batched_tokens if info is not None else 0
    return admission.PrefillLoad(queued, budget or 1024, slowdown.scale(_step(s)))
