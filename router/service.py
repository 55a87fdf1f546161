"""The public `pdserve.v1.PDServe` gRPC service: parsing, validation, statuses, protobuf mapping.

The service is registered with raw-bytes handlers (`handlers`), so the router parses each
request itself: a malformed message is INVALID_ARGUMENT, not the UNKNOWN grpc answers when its
own deserializer fails. The server's receive limit (`RequestLimits.max_message_bytes`) refuses
anything larger before it is read (gRPC's own RESOURCE_EXHAUSTED, without a retry hint).

    Generate: parse ─► check_generate (no tokenizer) ─► tokenise off the loop ─► complete
              ─► frontend.generate (admission, flow) ─► responses
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
from router.frontend import Frontend, OutputChunk, Overloaded
from router.tokenize import TokenizerBusy
from router.validation import RequestError, check_generate, complete

log = logging.getLogger(__name__)

SERVICE = "pdserve.v1.PDServe"
RETRY_AFTER_KEY = "retry-after-ms"
"""Trailing metadata of a RESOURCE_EXHAUSTED: milliseconds to wait before trying again."""

_FINISH = {None: pb.FINISH_REASON_UNSPECIFIED, "stop": pb.FINISH_REASON_STOP,
           "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}


class PDServeService:
    def __init__(self, frontend: Frontend, max_model_len: int, model_id: str) -> None:
        self.frontend = frontend
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
        limits = self.frontend.limits
        try:
            inp = check_generate(request, limits, self.model_id)
            ids = inp.token_ids
            if inp.text is not None:
                ids = await self.frontend.tokens.encode(inp.text)
            req = complete(inp, ids, limits)
        except RequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except TokenizerBusy as exc:
            await _abort_retry(context, str(exc), exc.retry_after_s)
        public_id = req.request_id or uuid.uuid4().hex
        try:
            async for chunk in self.frontend.generate(req, context.time_remaining()):
                yield _to_pb(public_id, chunk)
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


def _to_pb(rid: str, c: OutputChunk) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(request_id=rid, token_ids=c.token_ids, text=c.text,
                              logprobs=c.logprobs, finish_reason=_FINISH[c.finish_reason])
    if c.usage is not None:
        msg.usage.CopyFrom(pb.Usage(prompt_tokens=c.usage.prompt_tokens,
                                    completion_tokens=c.usage.completion_tokens,
                                    cached_tokens=c.usage.cached_tokens))
    return msg
