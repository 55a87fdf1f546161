"""The public gRPC service over a scripted frontend (no workers), on a real grpc.aio server:
malformed messages are INVALID_ARGUMENT, oversized ones are refused by the receive limit, a
refusal by admission carries its retry hint."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.demo_model import write_tokenizer_files
from pdserve.engine.finish import FinishReason
from pdserve.proto import pb, pb_grpc
from pdserve.serving.grpc_server import start_server
from pdserve.tokenizer import Tokenizer
from router.frontend import OutputChunk, Overloaded, Usage
from router.service import RETRY_AFTER_KEY, PDServeService
from router.tokenize import TokenizerPool
from router.validation import RequestLimits

LIMITS = RequestLimits(max_model_len=128, vocab_size=512, max_token_bytes=4)


class Frontend:
    def __init__(self, tokenizer, refuse: float | None = None):
        self.limits = LIMITS
        self.tokens = TokenizerPool(tokenizer)
        self.refuse = refuse
        self.requests = []

    async def generate_choices(self, reqs, n, timeout_s):
        (req,) = reqs
        self.requests.append(req)
        if self.refuse is not None:
            raise Overloaded("over capacity: decode queue full", self.refuse)
        yield OutputChunk([7], "x")
        yield OutputChunk([], "", [], FinishReason.LENGTH,
                          Usage(len(req.prompt_token_ids), 1, 0))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return Tokenizer.from_pretrained(write_tokenizer_files(tmp_path_factory.mktemp("tok"), 512))


def call(tokenizer, scenario, refuse=None):
    frontend = Frontend(tokenizer, refuse)

    async def main():
        service = PDServeService(frontend, LIMITS.max_model_len, "tiny")
        server = await start_server("127.0.0.1", 0,
                                    lambda s: s.add_generic_rpc_handlers((service.handlers(),)),
                                    ["pdserve.v1.PDServe"],
                                    max_receive_bytes=LIMITS.max_message_bytes)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
                return await scenario(ch)
        finally:
            await server.server.stop(None)

    return asyncio.run(main()), frontend


async def _raw_generate(ch, raw: bytes):
    rpc = ch.unary_stream("/pdserve.v1.PDServe/Generate", request_serializer=None,
                          response_deserializer=pb.GenerateResponse.FromString)
    try:
        return [m async for m in rpc(raw, timeout=10)], None
    except grpc.aio.AioRpcError as exc:
        return None, exc


def test_a_valid_request_streams(tokenizer):
    async def scenario(ch):
        stub = pb_grpc.PDServeStub(ch)
        return [m async for m in stub.Generate(pb.GenerateRequest(text="hello"), timeout=10)]

    msgs, fe = call(tokenizer, scenario)
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert fe.requests[0].prompt_token_ids == tokenizer.encode("hello")


@pytest.mark.parametrize("raw", [b"\xff\xff\xff", b"\x1a\x05ab", b"\x1a\x02\xc3\x28"])
def test_malformed_protobuf_is_invalid_argument(tokenizer, raw):
    (msgs, err), fe = call(tokenizer, lambda ch: _raw_generate(ch, raw))
    assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed GenerateRequest" in err.details() and fe.requests == []


def test_malformed_list_models_is_invalid_argument(tokenizer):
    async def scenario(ch):
        rpc = ch.unary_unary("/pdserve.v1.PDServe/ListModels", request_serializer=None,
                             response_deserializer=pb.ListModelsResponse.FromString)
        try:
            await rpc(b"\xff\xff", timeout=10)
        except grpc.aio.AioRpcError as exc:
            return exc.code()

    code, _ = call(tokenizer, scenario)
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_text_over_the_byte_bound_is_invalid_argument_and_over_the_message_limit_is_refused(
        tokenizer):
    async def scenario(ch):
        stub = pb_grpc.PDServeStub(ch)
        out = []
        for text in ("a" * (LIMITS.max_prompt_bytes + 1), "a" * (LIMITS.max_message_bytes + 1)):
            try:
                [m async for m in stub.Generate(pb.GenerateRequest(text=text), timeout=10)]
            except grpc.aio.AioRpcError as exc:
                out.append(exc.code())
        return out

    codes, fe = call(tokenizer, scenario)
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert fe.requests == []


def test_an_admission_refusal_carries_retry_after_ms(tokenizer):
    async def scenario(ch):
        call_ = pb_grpc.PDServeStub(ch).Generate(pb.GenerateRequest(text="hi"), timeout=10)
        try:
            [m async for m in call_]
        except grpc.aio.AioRpcError as exc:
            return exc.code(), dict(exc.trailing_metadata())

    (code, trailing), _ = call(tokenizer, scenario, refuse=1.25)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert trailing[RETRY_AFTER_KEY] == "1250"


def test_a_chat_over_the_byte_bound_is_refused_before_its_template_and_one_within_runs(
        tokenizer):
    def chat(content: str, messages: int = 1) -> pb.GenerateRequest:
        return pb.GenerateRequest(chat=pb.ChatPrompt(messages=[
            pb.ChatMessage(role="user", content=content) for _ in range(messages)]))

    async def scenario(ch):
        stub = pb_grpc.PDServeStub(ch)
        out = []
        for req in (chat("a" * (LIMITS.max_prompt_bytes + 1)), chat("", LIMITS.max_model_len),
                    chat("hi")):
            try:
                msgs = [m async for m in stub.Generate(req, timeout=10)]
                out.append(msgs[-1].finish_reason)
            except grpc.aio.AioRpcError as exc:
                out.append(exc.code())
        return out

    codes, fe = call(tokenizer, scenario)
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT,
                     pb.FINISH_REASON_LENGTH]
    assert [r.prompt_token_ids for r in fe.requests] == [
        tokenizer.encode_chat([{"role": "user", "content": "hi"}])]
