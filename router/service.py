"""The public `pdserve.v1.PDServe` gRPC service: parsing, validation, statuses, protobuf mapping.

The service is registered with raw-bytes handlers (`handlers`), so the router parses each
request itself: a malformed message is INVALID_ARGUMENT, not the UNKNOWN grpc answers when its
own deserializer fails. The server's receive limit (`RequestLimits.max_message_bytes`) refuses
anything larger before it is read (gRPC's own RESOURCE_EXHAUSTED, without a retry hint).

    Generate: parse ─► a chat: check_chat (bytes), its template off the loop (router.tokenize)
              ─► check_generate (no tokenizer) ─► tokenise off the loop ─► complete
              ─► check_constraint ─► frontend (admission, flow) ─► responses (grpc_chat)
    A refusal by admission (or a busy tokenizer) is RESOURCE_EXHAUSTED with trailing metadata
    `retry-after-ms`; the SDK waits that long before it retries.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import grpc
from google.protobuf.message import DecodeError

from pdserve.proto import pb
from router.flow import FlowError
from router.frontend import Frontend, Overloaded
from router.grpc_chat import check_constraint, prepare_request, stream_choices
from router.openai.tools import ToolConfig
from router.tokenize import TokenizerBusy
from router.validation import check_chat, check_generate, complete

log = logging.getLogger(__name__)

SERVICE = "pdserve.v1.PDServe"
RETRY_AFTER_KEY = "retry-after-ms"
"""Trailing metadata of a RESOURCE_EXHAUSTED: milliseconds to wait before trying again."""


class PDServeService:
    def __init__(self, frontend: Frontend, max_model_len: int, model_id: str,
                 tools: ToolConfig | None = None) -> None:
        self.frontend = frontend
        self.tools = tools or ToolConfig()
        self.max_model_len = max_model_len
        self.model_id = model_id

    def handlers(self) -> grpc.GenericRpcHandler:
        """The service's method handlers; they receive the request's raw bytes."""
        return grpc.method_handlers_generic_handler(SERVICE, {
            "Generate": grpc.unary_stream_rpc_method_handler(
                self.Generate, response_serializer=pb.GenerateResponse.SerializeToString),
            "ListModels": grpc.unary_unary_rpc_method_handler(
                self.ListModels, response_serializer=pb.ListModelsResponse.SerializeToString),
        })

    async def ListModels(self, raw: bytes, context):
        await _parse(pb.ListModelsRequest, raw, context)
        return pb.ListModelsResponse(models=[pb.ModelCard(
            id=self.model_id, max_model_len=self.max_model_len, owned_by="pdserve")])

    async def Generate(self, raw: bytes, context):
        request = await _parse(pb.GenerateRequest, raw, context)
        limits, tokens = self.frontend.limits, self.frontend.tokens
        try:
            if request.WhichOneof("prompt") == "chat":
                check_chat(request.chat, limits)  # before the template renders it
            request, tools = await prepare_request(request, tokens, self.tools)
            inp = check_generate(request, limits, self.model_id)
            ids = inp.token_ids
            if inp.text is not None:
                ids = await tokens.encode(inp.text)
            req = complete(inp, ids, limits)
            await check_constraint(req)
        except ValueError as exc:  # RequestError, a chat the template refuses, a bad schema
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except TokenizerBusy as exc:
            await _abort_retry(context, str(exc), exc.retry_after_s)
        public_id = req.request_id or uuid.uuid4().hex
        try:
            async for msg in stream_choices(self.frontend, req, request.n, public_id, tools,
                                            self.tools, context.time_remaining()):
                yield msg
        except Overloaded as exc:
            await _abort_retry(context, str(exc), exc.retry_after_s)
        except FlowError as exc:
            left = context.time_remaining()
            # A worker call cut by the request's own deadline ends CANCELLED or UNAVAILABLE
            # on its side; the client's status is the deadline.
            code = grpc.StatusCode.DEADLINE_EXCEEDED if left is not None and left <= 0 \
                else exc.code
            await context.abort(code, str(exc))
        except asyncio.CancelledError:
            log.info("request %s cancelled by the client", public_id)
            raise


async def _parse(message_type, raw: bytes, context):
    try:
        return message_type.FromString(raw)
    except DecodeError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"malformed {message_type.DESCRIPTOR.name}: {exc}")


async def _abort_retry(context, message: str, retry_after_s: float) -> None:
    ms = max(int(retry_after_s * 1000), 1)
    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message,
                        trailing_metadata=((RETRY_AFTER_KEY, str(ms)),))
