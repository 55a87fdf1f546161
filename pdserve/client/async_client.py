"""`AsyncClient`: the asyncio Python client of the pdserve public API.

The same API and semantics as `Client` (deadlines, retries, errors), with `await` and
`async for`. The grpc.aio channel is opened on first use, inside the event loop that uses it, so
an AsyncClient may be constructed before the loop runs; use one instance from one loop.

    async with AsyncClient("127.0.0.1:50051") as client:
        completion = await client.generate("Hello", max_tokens=8)
        async for chunk in client.stream("Hello", max_tokens=8):
            ...
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
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


class AsyncClient:
    """asyncio client; reuse one instance per event loop (it holds a connection)."""

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
        """Same arguments as `Client`."""
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
        self._channel: grpc.aio.Channel | None = None
        self._stub_cache: pb_grpc.PDServeStub | None = None

    async def generate(self, prompt: Prompt, **options: Unpack[GenerateKwargs]) -> Completion:
        """Generates a completion for prompt and returns it whole (see `Client.generate`)."""
        opts = make_options(options)
        if (opts.n or 1) > 1:
            raise InvalidArgument("n: generate returns one completion; use generate_choices")
        request = build_request(prompt, opts)
        chunks = await self._collect(request, opts)
        return response.assemble(chunks, request_id=request.request_id,
                                 want_logprobs=opts.logprobs is not None)

    async def generate_choices(self, prompt: Prompt, **options: Unpack[GenerateKwargs]
                               ) -> list[Completion]:
        """`n` completions of the prompt (see `Client.generate_choices`)."""
        opts = make_options(options)
        request = build_request(prompt, opts)
        chunks = await self._collect(request, opts)
        return response.assemble_choices(chunks, request_id=request.request_id,
                                         want_logprobs=opts.logprobs is not None,
                                         n=opts.n or 1)

    async def _collect(self, request: pb.GenerateRequest, opts) -> list[Chunk]:
        want_logprobs = opts.logprobs is not None

        async def attempt(timeout: float | None) -> list[Chunk]:
            call = self._stub().Generate(request, timeout=timeout, metadata=self._config.metadata)
            try:
                rid = request.request_id
                return [
                    response.chunk(m, request_id=rid, want_logprobs=want_logprobs)
                    async for m in call
                ]
            finally:
                call.cancel()

        return await self._with_retries(attempt, self._config.timeout_for(opts.timeout))

    def stream(self, prompt: Prompt, **options: Unpack[GenerateKwargs]) -> AsyncIterator[Chunk]:
        """Yields chunks as the server produces them (see `Client.stream`); use `async for`."""
        opts = make_options(options)
        request = build_request(prompt, opts)
        timeout = self._config.timeout_for(opts.timeout)
        return self._stream(request, opts.logprobs is not None, timeout)

    async def list_models(self, *, timeout: float | None = None) -> list[ModelCard]:
        """The models the deployment serves, the default first."""

        async def attempt(call_timeout: float | None) -> pb.ListModelsResponse:
            return await self._stub().ListModels(
                pb.ListModelsRequest(), timeout=call_timeout, metadata=self._config.metadata
            )

        reply = await self._with_retries(attempt, self._config.timeout_for(timeout))
        return response.model_cards(reply)

    async def close(self) -> None:
        """Closes the channel; calls in flight are cancelled."""
        if self._channel is not None:
            await self._channel.close()
            self._channel, self._stub_cache = None, None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _stub(self) -> pb_grpc.PDServeStub:
        """The stub, opening the channel in the running loop on first use."""
        if self._stub_cache is None:
            config = self._config
            self._channel = channel.open_aio_channel(
                config.target, config.credentials, config.options
            )
            self._stub_cache = pb_grpc.PDServeStub(self._channel)
        return self._stub_cache

    async def _with_retries(
        self, attempt: Callable[[float | None], Awaitable[T]], timeout: float | None
    ) -> T:
        """Awaits attempt(remaining seconds) until it succeeds or fails for good."""
        deadline = Deadline.after(timeout)
        retries = 0
        while True:
            try:
                return await attempt(deadline.remaining())
            except grpc.RpcError as err:
                error = from_rpc_error(err)
                wait = next_wait(self._config.retry, error.code, retries, deadline, self._rng,
                                 error.retry_after_s)
                if wait is None:
                    raise error from err
            await asyncio.sleep(wait)
            retries += 1

    async def _stream(
        self, request: pb.GenerateRequest, want_logprobs: bool, timeout: float | None
    ) -> AsyncIterator[Chunk]:
        deadline = Deadline.after(timeout)
        retries = 0
        last: Chunk | None = None
        while last is None:
            call = self._stub().Generate(
                request, timeout=deadline.remaining(), metadata=self._config.metadata
            )
            try:
                async for msg in call:
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
            await asyncio.sleep(wait)
            retries += 1
        if last is None or last.finish_reason is None:
            raise Internal(f"request {request.request_id}: stream ended without a finish reason")
