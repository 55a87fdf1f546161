"""What every public API shares once a request is validated: admission, run the flow, turn
tokens into text (stop strings included), account usage. gRPC (`service.py`) and OpenAI HTTP
map these typed chunks onto their own wire formats.

    generate(req, n) ─► accepting? (else UNAVAILABLE: shutting down)
                     ─► gate.admit (router.gate: pool loads, request size, deadline)
                          refused ─► Overloaded (RESOURCE_EXHAUSTED, retry_after_s), nothing sent
                     ─► flow.run(..., decode workers admission allows) ─► chunks

One choice's chunks:

    token chunk ... token chunk ─ last token chunk (finish_reason + usage)
                                └ or, when the end was not foreseeable, an empty final chunk

The router applies the engine's token-level stop rules (`pdserve.engine.stop`)
to every token it receives, so it knows a token is the last one as soon as it arrives: that
chunk waits only for the decode worker's `finished` event (sent in the same step) and carries
the finish reason with the text, as OpenAI clients expect. A prompt's `n` choices are one
flow (the decode worker forks them from the prompt's KV, computed once); their chunks, and
those of a batch of prompts, interleave, each tagged with its `index`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field

import grpc

from pdserve.engine.finish import FinishReason
from pdserve.engine.stop import apply_stop_rules
from pdserve.observability.router_metrics import RouterMetrics, status_of
from pdserve.proto import pb
from pdserve.text_stream import TextStream
from pdserve.tokenizer import Tokenizer
from router.config import RouterConfig
from router.flow import FinishEvent, Flow, FlowError, FlowTimings, TokenEvent
from router.gate import AdmissionGate, Overloaded
from router.migration import MigrationPolicy
from router.pool import WorkerPool
from router.tokenize import TokenizerPool
from router.validation import RequestLimits, ValidRequest

__all__ = ["FinishRules", "Frontend", "OutputChunk", "Overloaded", "Usage", "UsageTotal"]

log = logging.getLogger("router.requests")


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class OutputChunk:
    """New tokens and text of one choice; `finish_reason` and `usage` are set on its last
    chunk only."""

    token_ids: list[int]
    text: str
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    index: int = 0
    """The choice (0 .. choices-1): prompt i, sample j of n is choice i * n + j."""
    prompt_logprobs: list[pb.TokenLogprob] | None = None
    """On a choice's first chunk, when prompt logprobs were asked."""
    stop_reason: str | int | None = None
    """On the last chunk of a choice that a stop string (that string) or one of the
    request's stop_token_ids (that id) ended; None for EOS or any other end (vLLM's)."""


class UsageTotal:
    """Usage of a request with several choices: each prompt counted once (its cache hit as
    the least any of its choices had: what sharing among the choices saved is not a hit),
    completion tokens summed over every choice."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._prompts: dict[int, Usage] = {}
        self._completion = 0
        self.finished = 0

    def add(self, u: Usage, index: int) -> None:
        """The final usage of choice `index` (sample index % n of prompt index // n)."""
        self.finished += 1
        self._completion += u.completion_tokens
        seen = self._prompts.get(index // self.n)
        if seen is None or u.cached_tokens < seen.cached_tokens:
            self._prompts[index // self.n] = u

    def total(self) -> Usage:
        return Usage(sum(u.prompt_tokens for u in self._prompts.values()), self._completion,
                     sum(u.cached_tokens for u in self._prompts.values()))


@dataclass(frozen=True)
class FinishRules:
    """What the engine stops on, so the router knows a request's last token on arrival."""

    eos_token_ids: frozenset[int]
    max_model_len: int


class Frontend:
    def __init__(self, config: RouterConfig, tokenizer: Tokenizer, prefill: WorkerPool,
                 decode: WorkerPool, metrics: RouterMetrics | None = None,
                 rules: FinishRules | None = None, limits: RequestLimits | None = None
                 ) -> None:
        self.config = config
        self.metrics = metrics if metrics is not None else RouterMetrics()
        self.tokenizer = tokenizer
        self.tokens = TokenizerPool(tokenizer)
        self.limits = limits if limits is not None else RequestLimits(
            32768, tokenizer.vocab_size, tokenizer.max_token_bytes)
        self.rules = rules
        self.prefill, self.decode = prefill, decode
        self.gate = AdmissionGate(config, prefill, decode, self.limits, self.metrics)
        self._rng = random.Random(uuid.uuid4().int)
        self.flow = Flow(prefill, decode, config.local_prefill_tokens,
                         random.Random(uuid.uuid4().int), config.routing,
                         MigrationPolicy(limit=config.migration_limit))
        counters = self.flow.counters  # the dict the flow increments in place
        self.metrics.export_flow_counters(lambda: counters)
        self.inflight = 0
        self.accepting = True  # False once shutting down: new requests get UNAVAILABLE

    async def generate_choices(self, reqs: Sequence[ValidRequest], n: int,
                               timeout_s: float | None) -> AsyncIterator[OutputChunk]:
        """Stream `n` choices of each request (prompt), interleaved, tagged with `index`;
        raises `FlowError`. Each prompt's choices are one flow: the decode worker forks them
        from the prompt's KV, computed once; choice j samples with `choice_seed(seed, j)`,
        so seeded requests are reproducible and their choices distinct."""
        if len(reqs) == 1:
            async with aclosing(self.generate(reqs[0], timeout_s, n)) as chunks:
                async for c in chunks:
                    yield c
            return
        async with aclosing(_merge([self.generate(r, timeout_s, n, i * n)
                                    for i, r in enumerate(reqs)])) as chunks:
            async for c in chunks:
                yield c

    async def generate(self, req: ValidRequest, timeout_s: float | None, n: int = 1,
                       base_index: int = 0) -> AsyncIterator[OutputChunk]:
        """Stream the `n` choices of one prompt (indexes base_index ..); raises `FlowError`
        with the status to return (`Overloaded` when admission refuses it, before anything
        is sent)."""
        rid = f"{req.request_id or 'req'}-{uuid.uuid4().hex[:12]}"  # unique on the workers
        timeout = self.config.default_timeout_s if timeout_s is None else timeout_s
        if not self.accepting:
            raise FlowError(grpc.StatusCode.UNAVAILABLE, "router is shutting down")
        if n > 1 and req.params.seed is None:  # one seed for the request: its choices derive
            req = dataclasses.replace(req, params=dataclasses.replace(
                req.params, seed=self._rng.getrandbits(63)))
        timings = FlowTimings()
        # The workers know the request by `rid`; its prefix is the client's id, when given.
        choices = [_Choice(self, req, rid if j == 0 else f"{rid}.c{j}", base_index + j, n,
                           timings) for j in range(n)]
        left = n
        prompt_lps: list[pb.TokenLogprob] | None = None
        self.inflight += n
        try:
            allowed = self.gate.admit(rid, req, n, timeout)
            async for ev in self.flow.run(rid, req, timeout, timings, n,
                                          decode_allowed=allowed):
                c = choices[ev.index] if 0 <= ev.index < n else None
                if c is None or c.done:
                    continue  # a choice the router ended (a stop string)
                if isinstance(ev, TokenEvent):
                    self.gate.on_tokens(rid, len(ev.token_ids))
                    prompt_lps = prompt_lps or ev.prompt_logprobs or None
                    out = c.on_tokens(ev, prompt_lps)
                    if c.done and n > 1:
                        self.flow.stop_choice(rid, ev.index)
                else:
                    out = [c.on_finish(ev)]
                for chunk in out:
                    yield chunk
                left -= c.done
                if left == 0:
                    return
            for c in choices:  # the flow always ends every choice or raises
                c.trace.finish("INTERNAL")
        except BaseException as exc:
            for c in choices:
                c.trace.finish(status_of(exc))
            raise
        finally:
            self.inflight -= n
            self.gate.end(rid)

    def _ends(self, p, n_prompt: int, n_output: int, tokens: list[int]) -> bool:
        """Whether the engine's stop rules end the request with these tokens."""
        if self.rules is None:
            return False
        _, reason = apply_stop_rules(p, n_prompt, n_output, tokens, self.rules.eos_token_ids,
                                     self.rules.max_model_len)
        return reason is not None


class _Choice:
    """One choice's text (stop strings, detokenizing), trace, and the chunk held for its
    foreseen end (the finish reason rides on the last token's chunk)."""

    def __init__(self, frontend: Frontend, req: ValidRequest, rid: str, index: int,
                 n: int, timings: FlowTimings) -> None:
        p = req.params
        self.frontend, self.params, self.index, self.timings = frontend, p, index, timings
        self.text = TextStream(frontend.tokenizer, req.prompt_token_ids, p.stop,
                               p.include_stop_str_in_output, req.skip_special_tokens)
        self.n_prompt, self.sent = len(req.prompt_token_ids), 0
        self.held: OutputChunk | None = None
        self.first = True
        self.done = False
        self.last_token: int | None = None
        self.trace = frontend.metrics.trace(rid, self.n_prompt, log, n=n,
                                            max_tokens=p.max_tokens)

    def on_tokens(self, ev: TokenEvent, prompt_lps) -> list[OutputChunk]:
        out = []
        if self.held is not None:  # rules disagreed with the worker's: not the end
            out.append(self.held)
            self.held = None
        last = self.frontend._ends(self.params, self.n_prompt, self.sent, ev.token_ids)
        self.sent += len(ev.token_ids)
        if ev.token_ids:
            self.last_token = ev.token_ids[-1]
        self.trace.on_tokens(len(ev.token_ids))
        delta = self.text.add(ev.token_ids, final=last)
        lps = ev.logprobs if self.params.logprobs is not None else []
        chunk = OutputChunk(ev.token_ids, delta.text, lps, index=self.index,
                            prompt_logprobs=prompt_lps if self.first else None)
        self.first = False
        if delta.stopped:
            t = self.timings
            cached = t.prefill_cached_tokens if t.prefill_remote else 0
            self.trace.finish("OK", cached, FinishReason.STOP,  # before the yield: the
                              t.prefill_compute_s)  # caller may stop reading
            self.done = True
            out.append(dataclasses.replace(chunk, finish_reason=FinishReason.STOP,
                                           usage=Usage(self.n_prompt, self.sent, cached),
                                           stop_reason=self.text.matched))
        elif last:
            self.held = chunk
        else:
            out.append(chunk)
        return out

    def on_finish(self, ev: FinishEvent) -> OutputChunk:
        self.trace.finish("OK", ev.cached_tokens, ev.reason, self.timings.prefill_compute_s)
        self.done = True
        held = self.held or OutputChunk([], "", [], index=self.index)
        return dataclasses.replace(held, text=held.text + self.text.finish().text,
                                   finish_reason=ev.reason,
                                   usage=Usage(self.n_prompt, self.sent, ev.cached_tokens),
                                   stop_reason=self._stop_token(ev.reason))

    def _stop_token(self, reason: FinishReason) -> int | None:
        """The request's own stop token that ended it (EOS is no stop_reason, as in vLLM)."""
        eos = self.frontend.rules.eos_token_ids if self.frontend.rules is not None else ()
        t = self.last_token
        p = self.params
        if reason == FinishReason.STOP and t in p.stop_token_ids and (p.ignore_eos
                                                                      or t not in eos):
            return t
        return None


async def _merge(streams: list[AsyncIterator[OutputChunk]]) -> AsyncIterator[OutputChunk]:
    """Interleave several choices' chunks in arrival order. The first error ends it all;
    leaving early (or an error) closes every stream, which cancels its flow."""
    queue: asyncio.Queue = asyncio.Queue()
    _END = object()

    async def pump(stream: AsyncIterator[OutputChunk]) -> None:
        try:
            async with aclosing(stream) as chunks:
                async for c in chunks:
                    queue.put_nowait(c)
            queue.put_nowait(_END)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # handed to the consumer, which raises it
            queue.put_nowait(exc)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is _END:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
