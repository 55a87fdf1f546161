"""The public `pdserve.v1.PDServe` service: validation, the flow, text, usage, statuses."""

from __future__ import annotations

import asyncio
import logging
import random
import uuid

import grpc

from pdserve.proto import pb, pb_grpc
from pdserve.text_stream import TextStream
from pdserve.tokenizer import Tokenizer
from router.config import RouterConfig
from router.flow import FinishEvent, Flow, FlowError, FlowTimings, TokenEvent
from router.pool import WorkerPool
from router.validation import validate

log = logging.getLogger(__name__)


class PDServeService(pb_grpc.PDServeServicer):
    def __init__(self, config: RouterConfig, tokenizer: Tokenizer, prefill: WorkerPool,
                 decode: WorkerPool, vocab_size: int, max_model_len: int, model_id: str
                 ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.model_id = model_id
        self.flow = Flow(prefill, decode, config.local_prefill_tokens,
                         random.Random(uuid.uuid4().int))
        self.inflight = 0

    async def ListModels(self, request, context):
        return pb.ListModelsResponse(models=[pb.ModelCard(
            id=self.model_id, max_model_len=self.max_model_len, owned_by="pdserve")])

    async def Generate(self, request, context):
        try:
            req = validate(request, self.tokenizer, self.vocab_size, self.max_model_len,
                           self.model_id)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if self.inflight >= self.config.max_inflight:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"router has {self.inflight} requests in flight")
        public_id = req.request_id or uuid.uuid4().hex
        rid = f"{public_id}-{uuid.uuid4().hex[:8]}"  # unique on the workers
        remaining = context.time_remaining()
        timeout = self.config.default_timeout_s if remaining is None else remaining
        text = TextStream(self.tokenizer, req.prompt_token_ids, req.params.stop,
                          req.params.include_stop_str_in_output)
        want_lp = req.params.logprobs is not None
        sent = 0
        self.inflight += 1
        try:
            async for ev in self.flow.run(rid, req, timeout, FlowTimings()):
                if isinstance(ev, TokenEvent):
                    sent += len(ev.token_ids)
                    delta = text.add(ev.token_ids)
                    yield pb.GenerateResponse(request_id=public_id, token_ids=ev.token_ids,
                                              text=delta.text,
                                              logprobs=ev.logprobs if want_lp else [])
                    if delta.stopped:
                        yield _final(public_id, "stop", "", len(req.prompt_token_ids), sent, 0)
                        return
                elif isinstance(ev, FinishEvent):
                    tail = text.finish().text
                    yield _final(public_id, ev.reason, tail, len(req.prompt_token_ids), sent,
                                 ev.cached_tokens)
                    return
        except FlowError as exc:
            await context.abort(exc.code, str(exc))
        except asyncio.CancelledError:
            log.info("request %s cancelled by the client", public_id)
            raise
        finally:
            self.inflight -= 1


def _final(rid: str, reason: str, text: str, prompt: int, completion: int,
           cached: int) -> pb.GenerateResponse:
    reasons = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
               "abort": pb.FINISH_REASON_ABORT}
    return pb.GenerateResponse(
        request_id=rid, text=text, finish_reason=reasons[reason],
        usage=pb.Usage(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached))
