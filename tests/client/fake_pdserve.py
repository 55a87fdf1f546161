"""A real gRPC server on loopback with a scriptable fake `PDServe` servicer, for the SDK tests.

The fake echoes the prompt back: output tokens are the prompt's tokens (a text prompt's tokens
are its characters' code points), `max_tokens` of them at most, two per stream message. Tests
script failures and checks through the servicer's public attributes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc

from pdserve.proto import pb, pb_grpc

TOKENS_PER_CHUNK = 2
DEFAULT_MAX_TOKENS = 16


def echo_tokens(request: pb.GenerateRequest) -> tuple[list[int], list[int]]:
    """(prompt tokens, output tokens) the fake produces for a request."""
    prompt = (
        [ord(c) for c in request.text] if request.HasField("text") else list(request.token_ids.ids)
    )
    limit = (
        request.sampling.max_tokens
        if request.sampling.HasField("max_tokens")
        else DEFAULT_MAX_TOKENS
    )
    return prompt, prompt[:limit]


def token_text(request: pb.GenerateRequest, token: int) -> str:
    return chr(token) if request.HasField("text") else f"<{token}>"


class FakePDServe(pb_grpc.PDServeServicer):
    """Records every call; fails, checks or stalls as the test scripts it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: list[pb.GenerateRequest] = []
        self.metadata: list[dict[str, str]] = []
        self.fail_before_output: list[grpc.StatusCode] = []
        """One status per call, consumed in order: abort before sending anything."""
        self.fail_after_first_chunk: list[grpc.StatusCode | None] = []
        """One status per call, consumed in order: abort after the first message."""
        self.required_token: str | None = None
        self.stall_after_first_chunk = False
        """Send one message, then wait until the client goes away (deadline or cancel)."""
        self.stall_before_output = False
        self.omit_finish = False
        """Protocol violation: end the stream without finish_reason and usage."""
        self.retry_after_ms: str | None = None
        """Sent as `retry-after-ms` trailing metadata with every scripted failure."""
        self.call_times: list[float] = []
        self.ended_early = threading.Event()
        """Set when a Generate RPC ended before the handler had sent all it meant to (the client
        cancelled or its deadline passed, or a scripted abort)."""

    @property
    def calls(self) -> int:
        with self.lock:
            return len(self.requests)

    def _admit(self, request, context) -> tuple[grpc.StatusCode | None, grpc.StatusCode | None]:
        metadata = dict(context.invocation_metadata())
        with self.lock:
            self.requests.append(request)
            self.metadata.append(metadata)
            self.call_times.append(time.monotonic())
            before = self.fail_before_output.pop(0) if self.fail_before_output else None
            after = self.fail_after_first_chunk.pop(0) if self.fail_after_first_chunk else None
        if self.required_token is not None:
            if metadata.get("authorization") != f"Bearer {self.required_token}":
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad or missing bearer token")
        return before, after

    def _watch(self, context) -> tuple[threading.Event, threading.Event]:
        """(ended, done): `ended` is set when the RPC ends; the handler sets `done` once it
        has sent everything, so an end without `done` is an early end."""
        ended, done = threading.Event(), threading.Event()

        def on_end() -> None:
            if not done.is_set():
                self.ended_early.set()
            ended.set()

        if not context.add_callback(on_end):  # False: the RPC has already ended
            on_end()
        return ended, done

    def Generate(self, request, context) -> Iterator[pb.GenerateResponse]:  # noqa: N802
        ended, done = self._watch(context)
        fail_before, fail_after = self._admit(request, context)
        if fail_before is not None:
            if self.retry_after_ms is not None:
                context.set_trailing_metadata((("retry-after-ms", self.retry_after_ms),))
            context.abort(fail_before, f"scripted {fail_before.name}")
        if self.stall_before_output:
            ended.wait(timeout=20)  # until the client leaves
            return
        prompt, output = echo_tokens(request)
        for start in range(0, max(len(output), 1), TOKENS_PER_CHUNK):
            tokens = output[start : start + TOKENS_PER_CHUNK]
            yield self._message(request, tokens)
            if start == 0 and fail_after is not None:
                context.abort(fail_after, f"scripted {fail_after.name} mid-stream")
            if start == 0 and self.stall_after_first_chunk:
                ended.wait(timeout=20)  # until the client leaves
                return
        if not self.omit_finish:
            yield self._final(request, prompt, output)
        done.set()

    def _message(self, request: pb.GenerateRequest, tokens: list[int]) -> pb.GenerateResponse:
        message = pb.GenerateResponse(
            request_id=request.request_id,
            token_ids=tokens,
            text="".join(token_text(request, t) for t in tokens),
        )
        if request.sampling.HasField("logprobs"):
            for t in tokens:
                top = [
                    pb.TopLogprob(token_id=t + k, logprob=-1.0 - k)
                    for k in range(request.sampling.logprobs)
                ]
                message.logprobs.append(pb.TokenLogprob(token_id=t, logprob=-1.0, top=top))
        return message

    def _final(self, request, prompt: list[int], output: list[int]) -> pb.GenerateResponse:
        finish = pb.FINISH_REASON_STOP if len(output) == len(prompt) else pb.FINISH_REASON_LENGTH
        usage = pb.Usage(prompt_tokens=len(prompt), completion_tokens=len(output), cached_tokens=1)
        return pb.GenerateResponse(request_id=request.request_id, finish_reason=finish, usage=usage)

    def ListModels(self, request, context) -> pb.ListModelsResponse:  # noqa: N802
        self._admit(request, context)
        return pb.ListModelsResponse(
            models=[pb.ModelCard(id="tiny-llama", max_model_len=2048, owned_by="pdserve")]
        )


@dataclass
class FakeServer:
    servicer: FakePDServe
    target: str
    server: grpc.Server


def start_server(servicer: FakePDServe, credentials: grpc.ServerCredentials | None = None):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_PDServeServicer_to_server(servicer, server)
    if credentials is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    return FakeServer(servicer=servicer, target=f"127.0.0.1:{port}", server=server)
