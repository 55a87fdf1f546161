"""The public `pdserve.v1.PDServe` gRPC service: validation, statuses, protobuf mapping."""

from __future__ import annotations

import asyncio
import logging
import uuid

import grpc

from pdserve.proto import pb, pb_grpc
from pdserve.serving.convert import finish_to_pb
from router.flow import FlowError
from router.frontend import Frontend, OutputChunk
from router.validation import validate

log = logging.getLogger(__name__)

class PDServeService(pb_grpc.PDServeServicer):
    def __init__(self, frontend: Frontend, vocab_size: int, max_model_len: int,
                 model_id: str) -> None:
        self.frontend = frontend
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.model_id = model_id

    async def ListModels(self, request, context):
        return pb.ListModelsResponse(models=[pb.ModelCard(
            id=self.model_id, max_model_len=self.max_model_len, owned_by="pdserve")])

    async def Generate(self, request, context):
        try:
            req = validate(request, self.frontend.tokenizer, self.vocab_size,
                           self.max_model_len, self.model_id)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if self.frontend.saturated:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"router has {self.frontend.inflight} requests in flight")
        public_id = req.request_id or uuid.uuid4().hex
        try:
            async for chunk in self.frontend.generate(req, context.time_remaining()):
                yield _to_pb(public_id, chunk)
        except FlowError as exc:
            await context.abort(exc.code, str(exc))
        except asyncio.CancelledError:
            log.info("request %s cancelled by the client", public_id)
            raise


def _to_pb(rid: str, c: OutputChunk) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(request_id=rid, token_ids=c.token_ids, text=c.text,
                              logprobs=c.logprobs, finish_reason=finish_to_pb(c.finish_reason))
    if c.usage is not None:
        msg.usage.CopyFrom(pb.Usage(prompt_tokens=c.usage.prompt_tokens,
                                    completion_tokens=c.usage.completion_tokens,
                                    cached_tokens=c.usage.cached_tokens))
    return msg
