"""The router's admission gate: builds `router.admission`'s inputs from the pools' stats and
this router's own ledger, and keeps that ledger as requests stream.

    admit(rid, request, n, deadline) ─► admission.decide(decode loads, prefill loads, size)
        refused  ─► Overloaded (RESOURCE_EXHAUSTED + retry hint), nothing recorded
        admitted ─► ledger += (n × max output tokens, prompt tokens until the first token)
                 ─► the decode workers that may take it
    on_tokens(rid, k)  ledger -= k; the stream's time per token feeds `Slowdown`
    end(rid)           whatever ended it (finish, error, cancel, migration exhausted)

The ledger covers what the workers' stats lag behind (a poll period): output tokens each
admitted request may still produce (their mean sizes the queue ahead of a new request) and
prompt tokens sent to prefill workers and not prefilled yet. `admit` reads and updates it with
no await in between, and the flow takes its decode worker before its first await, so a burst
of requests sees each other's effect.
"""

from __future__ import annotations

import time

import grpc

from pdserve.observability.router_metrics import RouterMetrics
from router import admission, policy
from router.config import RouterConfig
from router.flow import FlowError
from router.pool import WorkerHandle, WorkerPool
from router.validation import RequestLimits, ValidRequest


class Overloaded(FlowError):
    """Refused by admission control: RESOURCE_EXHAUSTED, retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
        self.retry_after_s = retry_after_s


class AdmissionGate:
    def __init__(self, config: RouterConfig, prefill: WorkerPool | None,
                 decode: WorkerPool | None, limits: RequestLimits,
                 metrics: RouterMetrics) -> None:
        """A pool may be None (a frontend over a scripted flow): it has no workers."""
        self.config, self.limits, self.metrics = config, limits, metrics
        self.prefill, self.decode = prefill, decode
        self._remaining: dict[str, int] = {}  # output tokens each request may still produce
        self._remaining_sum = 0
        self._prefilling: dict[str, int] = {}  # prompt tokens sent to P, no first token yet
        self.slowdown = admission.Slowdown()  # streams' time per token vs the step models
        self._last_token: dict[str, tuple[float, int]] = {}  # (when, events so far)

    def admit(self, rid: str, req: ValidRequest, n: int, timeout_s: float
              ) -> frozenset[str] | None:
        """The decode workers that may take the request (its `n` choices together);
        `Overloaded` if none may. None when no decode worker takes new work at all (none
        healthy, or all draining): the flow answers that (UNAVAILABLE, retryable)."""
        healthy = self.decode.routable() if self.decode is not None else []
        if not healthy:
            return None
        n_prompt, max_out = len(req.prompt_token_ids), self._max_out(req)
        prefill = self.prefill.routable() if self.prefill is not None else []
        remote = policy.prefill_remotely(n_prompt, 0, self.config.local_prefill_tokens,
                                         bool(prefill))
        size = admission.RequestSize(n_prompt, max_out, timeout_s, remote, max(n, 1))
        mean = self._remaining_sum / len(self._remaining) if self._remaining else max_out
        loads = [_decode_load(i, w, mean, self.slowdown) for i, w in enumerate(healthy)]
        pending = sum(self._prefilling.values()) / max(len(prefill), 1)  # the flow spreads it
        pre = [_prefill_load(w, pending, self.slowdown) for w in prefill]
        verdict = admission.decide(loads, pre, size, self.config.admission)
        if not verdict.admitted:
            raise Overloaded(f"over capacity: {verdict.reason}", verdict.retry_after_s)
        if remote:
            self._prefilling[rid] = n_prompt
        self._track(rid, max_out * max(n, 1))
        return frozenset(healthy[i].address for i in verdict.workers)

    def on_tokens(self, rid: str, tokens: int) -> None:
        self._prefilling.pop(rid, None)
        self._observe_itl(rid, tokens)
        self._track(rid, -tokens)

    def end(self, rid: str) -> None:
        self._track(rid, None)
        self._prefilling.pop(rid, None)
        self._last_token.pop(rid, None)

    def _max_out(self, req: ValidRequest) -> int:
        room = self.limits.max_model_len - len(req.prompt_token_ids)
        return max(min(req.params.max_tokens, room), 1)

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
        for w in self.decode.healthy() if self.decode is not None else ():
            step = _step(w.stats)
            if step is not None:
                occ = w.occupancy()
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
        occupancy=w.occupancy(),
        mean_remaining=mean_remaining, step=slowdown.scale(_step(s)))


def _prefill_load(w: WorkerHandle, pending_tokens: float,
                  slowdown: admission.Slowdown) -> admission.PrefillLoad:
    """`pending_tokens`: this worker's share of what the router admitted and has not seen
    prefilled (its stats lag by up to a poll period)."""
    s, info = w.stats, w.info
    queued = max(int(s.queued_prefill_tokens), int(pending_tokens))
    budget = info.max_num_batched_tokens if info is not None else 0
    return admission.PrefillLoad(queued, budget or 1024, slowdown.scale(_step(s)))
