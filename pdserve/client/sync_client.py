"""`Client`: the blocking Python client of the pdserve public API.

Owns one gRPC channel and the call loops (deadline, retries, error mapping) for the blocking API.
Request building, response conversion and retry policy are shared with `AsyncClient`.

    with Client("127.0.0.1:50051", token="...") as client:
        print(client.generate("The capital of France is", max_tokens=8, temperature=0).text)
        for chunk in client.stream([1, 15043, 29892], max_tokens=32):
            print(chunk.text, end="", flush=True)
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar, Unpack

import grpc

from pdserve.client import channel, response
from pdserve.client.config import make_config
from pdserve.client.datatypes import Chunk, Completion, ModelCard
from pdserve.client.errors import Internal, InvalidArgument, from_rpc_error
from pdserve.client.request import GenerateKwargs, Prompt, build_request, make_options
from pdserve.client.retry import Deadline, next_wait
from pdserve.proto import pb, pb_grpc

T = TypeVar("T")


class Client:
    """Blocking client. Thread-safe; reuse one instance (it holds a connection)."""

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        timeout: float | None = None,
        max_retries: int = 3,
        root_certificates: bytes | None = None,
        private_key: bytes | None = None,
        certificate_chain: bytes | None = None,
        initial_backoff_s: float = 0.1,
        max_backoff_s: float = 2.0,
        channel_options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        """Connects (lazily) to the router at target ("host:port").

        token: bearer token sent with every call. timeout: default deadline per call, seconds.
        max_retries: retries on UNAVAILABLE (and on RESOURCE_EXHAUSTED with a retry hint,
        after the hinted wait). root_certificates: PEM roots, enables TLS;
        private_key + certificate_chain (PEM) add a client certificate (mutual TLS).
        """
        self._config = make_config(
            target,
            token=token,
            timeout=timeout,
            max_retries=max_retries,
            initial_backoff_s=initial_backoff_s,
            max_backoff_s=max_backoff_s,
            root_certificates=root_certificates,
            private_key=private_key,
            certificate_chain=certificate_chain,
            channel_options=channel_options,
        )
        self._rng = random.Random()
        self._channel = channel.open_channel(target, self._config.credentials, self._config.options)
        self._stub = pb_grpc.PDServeStub(self._channel)

    def generate(self, prompt: Prompt, **options: Unpack[GenerateKwargs]) -> Completion:
        """Generates a completion for prompt (text or token ids) and returns it whole.

        Raises a PDServeError subclass on failure (InvalidArgument before sending anything when
        an argument is malformed). UNAVAILABLE is retried, even after partial output, since
        none of it was returned yet.
        """
        opts = make_options(options)
        if (opts.n or 1) > 1:
            raise InvalidArgument("n: generate returns one completion; use generate_choices")
        request = build_request(prompt, opts)
        chunks = self._collect(request, opts)
        return response.assemble(chunks, request_id=request.request_id,
                                 want_logprobs=opts.logprobs is not None)

    def generate_choices(self, prompt: Prompt, **options: Unpack[GenerateKwargs]
                         ) -> list[Completion]:
        """`n` completions of the prompt (`n=` in options, default 1), sharing its prefill;
        each samples with its own seed derived from the request's. In index order."""
        opts = make_options(options)
        request = build_request(prompt, opts)
        chunks = self._collect(request, opts)
        return response.assemble_choices(chunks, request_id=request.request_id,
                                         want_logprobs=opts.logprobs is not None,
                                         n=opts.n or 1)

    def _collect(self, request: pb.GenerateRequest, opts) -> list[Chunk]:
        want_logprobs = opts.logprobs is not None

        def attempt(timeout: float | None) -> list[Chunk]:
            call = self._stub.Generate(request, timeout=timeout, metadata=self._config.metadata)
            try:
                convert = response.chunk
                rid = request.request_id
                return [convert(m, request_id=rid, want_logprobs=want_logprobs) for m in call]
            finally:
                call.cancel()

        return self._with_retries(attempt, self._config.timeout_for(opts.timeout))

    def stream(self, prompt: Prompt, **options: Unpack[GenerateKwargs]) -> Iterator[Chunk]:
        """Generates a completion for prompt, yielding chunks as the server produces them.

        Arguments are validated at once; the call starts on the first `next()`. Closing the
        iterator early (leaving a `for` loop) cancels the request on the server. UNAVAILABLE is
        retried only until the first chunk has arrived.
        """
        opts = make_options(options)
        request = build_request(prompt, opts)
        timeout = self._config.timeout_for(opts.timeout)
        return self._stream(request, opts.logprobs is not None, timeout)

    def list_models(self, *, timeout: float | None = None) -> list[ModelCard]:
        """The models the deployment serves, the default first."""

        def attempt(call_timeout: float | None) -> pb.ListModelsResponse:
            return self._stub.ListModels(
                pb.ListModelsRequest(), timeout=call_timeout, metadata=self._config.metadata
            )

        return response.model_cards(self._with_retries(attempt, self._config.timeout_for(timeout)))

    def close(self) -> None:
        """Closes the channel; calls in flight are cancelled."""
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _with_retries(self, attempt: Callable[[float | None], T], timeout: float | None) -> T:
        """Runs attempt(remaining seconds) until it succeeds or fails for good."""
        deadline = Deadline.after(timeout)
        retries = 0
        while True:
            try:
                return attempt(deadline.remaining())
            except grpc.RpcError as err:
                error = from_rpc_error(err)
                wait = next_wait(self._config.retry, error.code, retries, deadline, self._rng,
                                 error.retry_after_s)
                if wait is None:
                    raise error from err
            time.sleep(wait)
            retries += 1

    def _stream(
        self, request: pb.GenerateRequest, want_logprobs: bool, timeout: float | None
    ) -> Iterator[Chunk]:
        deadline = Deadline.after(timeout)
        retries = 0
        last: Chunk | None = None
        while last is None:
            call = self._stub.Generate(
                request, timeout=deadline.remaining(), metadata=self._config.metadata
            )
            try:
                for msg in call:
                    last = response.chunk(
                        msg, request_id=request.request_id, want_logprobs=want_logprobs
                    )
                    yield last
                break
            except grpc.RpcError as err:
                error = from_rpc_error(err)
                wait = None
                if last is None:  # nothing reached the caller yet: a restart is invisible
                    wait = next_wait(self._config.retry, error.code, retries, deadline,
                                     self._rng, error.retry_after_s)
                if wait is None:
                    raise error from err
            finally:
                call.cancel()  # no-op once finished; stops the server when the caller leaves
            time.sleep(wait)
            retries += 1
        if last is None or last.finish_reason is None:
            raise Internal(f"request {request.request_id}: stream ended without a finish reason")
