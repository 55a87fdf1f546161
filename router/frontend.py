"""What every public API shares once a request is validated: run the flow, turn tokens into
text (stop strings included), account usage. gRPC (`service.py`) and OpenAI HTTP map these
typed chunks onto their own wire formats.
"""

from __future__ import annotations

import logging
import random
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pdserve.engine.finish import FinishReason
from pdserve.observability.router_metrics import RouterMetrics, status_of
from pdserve.proto import pb
from pdserve.text_stream import TextStream
from pdserve.tokenizer import Tokenizer
from router.config import RouterConfig
from router.flow import FinishEvent, Flow, FlowTimings, TokenEvent
from router.migration import MigrationPolicy
from router.pool import WorkerPool
from router.validation import ValidRequest

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
    finish_reason: FinishReason | None = None
    usage: Usage | None = None


class Frontend:
    def __init__(self, config: RouterConfig, tokenizer: Tokenizer, prefill: WorkerPool,
                 decode: WorkerPool, metrics: RouterMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics if metrics is not None else RouterMetrics()
        self.tokenizer = tokenizer
        self.flow = Flow(prefill, decode, config.local_prefill_tokens,
                         random.Random(uuid.uuid4().int), config.routing,
                         MigrationPolicy(limit=config.migration_limit))
        counters = self.flow.counters  # the dict the flow increments in place
        self.metrics.export_flow_counters(lambda: counters)
        self.inflight = 0

    @property
    def saturated(self) -> bool:
        return self.inflight >= self.config.max_inflight

    async def generate(self, req: ValidRequest, timeout_s: float | None
                       ) -> AsyncIterator[OutputChunk]:
        """Stream one request's output; raises `FlowError` with the status to return."""
        rid = f"{req.request_id or 'req'}-{uuid.uuid4().hex[:12]}"  # unique on the workers
        timeout = self.config.default_timeout_s if timeout_s is None else timeout_s
        p = req.params
        text = TextStream(self.tokenizer, req.prompt_token_ids, p.stop,
                          p.include_stop_str_in_output)
        want_lp = p.logprobs is not None
        n_prompt, sent = len(req.prompt_token_ids), 0
        # The workers know the request by `rid`; its prefix is the client's id, when given.
        trace = self.metrics.trace(rid, n_prompt, log)
        self.inflight += 1
        try:
            async for ev in self.flow.run(rid, req, timeout, FlowTimings()):
                if isinstance(ev, TokenEvent):
                    sent += len(ev.token_ids)
                    trace.on_tokens(len(ev.token_ids))
                    delta = text.add(ev.token_ids)
                    yield OutputChunk(ev.token_ids, delta.text, ev.logprobs if want_lp else [])
                    if delta.stopped:
                        trace.finish("OK")  # before the yield: the caller may stop reading
                        yield OutputChunk([], "", [], FinishReason.STOP, Usage(n_prompt, sent, 0))
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
