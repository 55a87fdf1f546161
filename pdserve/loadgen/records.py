"""What a backend observes of one request: when it was sent and when its tokens arrived.

A `Recorder` is filled in while the request streams (send, each token arrival, the usage, an
error) and frozen into a `RequestResult`, the only input of the metrics. Times are
`time.perf_counter()` seconds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Arrival:
    """Tokens that reached the client together (one stream message)."""

    time: float
    tokens: int


@dataclass(frozen=True)
class RequestResult:
    kind: str
    """The request's class label (see `BenchRequest.kind`)."""
    prompt_len: int
    send_time: float
    end_time: float
    """When the stream ended (finished, failed or cancelled)."""
    arrivals: tuple[Arrival, ...]
    """Token arrivals in order; empty when no token came back."""
    output_tokens: int
    """Tokens generated: the server's usage when it sent one, else the sum of arrivals."""
    cached_tokens: int | None = None
    """Prompt tokens the server reused from its cache, when it says."""
    error: str | None = None
    """The failure's status name ("RESOURCE_EXHAUSTED", "HTTP_503", ...); None on success."""
    error_detail: str | None = None
    """The server's (or the client library's) message for the failure."""

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.arrivals)


@dataclass
class Recorder:
    """Mutable while a request is in flight; `result()` freezes it."""

    kind: str
    prompt_len: int
    send_time: float = field(default_factory=time.perf_counter)
    arrivals: list[Arrival] = field(default_factory=list)
    usage_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None
    error_detail: str | None = None

    def tokens(self, n: int) -> None:
        """n tokens arrived now (n > 0)."""
        if n > 0:
            self.arrivals.append(Arrival(time.perf_counter(), n))

    def fail(self, status: str, detail: str = "") -> None:
        """Records the first failure (a later one is a consequence of it)."""
        if self.error is None:
            self.error, self.error_detail = status, detail or None

    def result(self) -> RequestResult:
        counted = sum(a.tokens for a in self.arrivals)
        error = self.error
        if error is None and not self.arrivals:
            error = "NO_OUTPUT"  # a stream that finished without a token is a failure here
        return RequestResult(
            kind=self.kind, prompt_len=self.prompt_len, send_time=self.send_time,
            end_time=time.perf_counter(), arrivals=tuple(self.arrivals),
            output_tokens=self.usage_tokens if self.usage_tokens is not None else counted,
            cached_tokens=self.cached_tokens, error=error, error_detail=self.error_detail)
