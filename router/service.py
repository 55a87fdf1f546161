"""The public `pdserve.v1.PDServe` gRPC service: validation, statuses, protobuf mapping."""

from __future__ import annotations

import asyncio
import logging
import uuid

import grpc

from pdserve.proto import pb, pb_grpc
from router.flow import FlowError
from router.frontend import Frontend
from router.grpc_chat import check_constraint, prepare_request, stream_choices
from router.openai.tools import ToolConfig
from router.validation import validate

log = logging.getLogger(__name__)


class PDServeService(pb_grpc.PDServeServicer):
    def __init__(self, frontend: Frontend, vocab_size: int, max_model_len: int,
                 model_id: str, tools: ToolConfig | None = None) -> None:
        self.frontend = frontend
        self.tools = tools or ToolConfig()
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.model_id = model_id

    async def ListModels(self, request, context):
        return pb.ListModelsResponse(models=[pb.ModelCard(
            id=self.model_id, max_model_len=self.max_model_len, owned_by="pdserve")])

    async def Generate(self, request, context):
        try:
            request, tools = await prepare_request(request, self.frontend.tokenizer,
                                                   self.tools)
            req = validate(request, self.frontend.tokenizer, self.vocab_size,
                           self.max_model_len, self.model_id)
            await check_constraint(req)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if self.frontend.saturated:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"router has {self.frontend.inflight} requests in flight")
        public_id = req.request_id or uuid.uuid4().hex
        try:
            async for msg in stream_choices(self.frontend, req, request.n, public_id, tools,
                                            self.tools, context.time_remaining()):
                yield msg
        except FlowError as exc:
            await context.abort(exc.code, str(exc))
        except asyncio.CancelledError:
            log.info("request %s cancelled by the client", public_id)
            raise

