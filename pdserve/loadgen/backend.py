"""The interface between the runner and a serving API, and the settings every backend shares.

A backend sends one `BenchRequest` as a streaming completion and returns what it observed as a
`RequestResult`; it never raises for a failed request (the failure is the result's `error`).
Two implementations: `grpc_backend.GrpcBackend` (the public gRPC API through the SDK) and
`openai_backend.OpenAIBackend` (OpenAI-compatible `/v1/completions` over HTTP, SSE).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from pdserve.loadgen.datasets import BenchRequest
from pdserve.loadgen.records import RequestResult
from pdserve.serving.security.tls import ClientTLS


@dataclass(frozen=True)
class SendOptions:
    """Sampling and transport settings applied to every request."""

    temperature: float = 0.0
    """0 is greedy; output lengths are fixed anyway (ignore_eos)."""
    timeout_s: float = 600.0
    """Deadline of each request."""
    token: str | None = field(default=None, repr=False)
    """Bearer token, when the server wants one."""
    model: str = ""
    """Model id ("" = the server's default)."""
    tls: ClientTLS | None = field(default=None, repr=False)
    """TLS to the server (its CA, and a client certificate for mTLS); None = plaintext."""


@dataclass(frozen=True)
class ServerInfo:
    """What the server says it serves."""

    model: str
    max_model_len: int
    """Prompt + completion tokens it accepts (0 when unknown)."""


class Backend(Protocol):
    async def server_info(self) -> ServerInfo:
        """The served model; raises when the server cannot be reached."""

    async def send(self, request: BenchRequest) -> RequestResult:
        """Streams one request to its end; failures are recorded, not raised."""

    async def close(self) -> None:
        """Releases connections (call from the loop that used the backend)."""
