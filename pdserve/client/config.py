"""The resolved, validated settings one client instance runs with (shared by sync and async)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from pdserve.client import channel
from pdserve.client.errors import InvalidArgument
from pdserve.client.retry import RetryPolicy


@dataclass(frozen=True)
class ClientConfig:
    """Everything a client needs besides its channel."""

    target: str
    """The router's address, "host:port"."""
    timeout_s: float | None
    """Default deadline for a call, in seconds; None for none."""
    metadata: tuple[tuple[str, str], ...]
    """Sent with every call (the bearer token)."""
    credentials: grpc.ChannelCredentials | None
    """TLS credentials; None for plaintext."""
    options: list[tuple[str, Any]]
    """gRPC channel options."""
    retry: RetryPolicy

    def timeout_for(self, call_timeout_s: float | None) -> float | None:
        """The deadline of one call: its own timeout, else the client's."""
        timeout = self.timeout_s if call_timeout_s is None else call_timeout_s
        return _check_timeout(timeout, InvalidArgument)


def _check_timeout(timeout: float | None, error: type[Exception]) -> float | None:
    if timeout is not None and (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not (math.isfinite(timeout) and timeout > 0)
    ):
        raise error(f"timeout: must be a positive number of seconds or None, got {timeout!r}")
    return timeout


def make_config(
    target: str,
    *,
    token: str | None,
    timeout: float | None,
    max_retries: int,
    initial_backoff_s: float,
    max_backoff_s: float,
    root_certificates: bytes | None,
    private_key: bytes | None,
    certificate_chain: bytes | None,
    channel_options: Sequence[tuple[str, Any]],
) -> ClientConfig:
    """Validates a client's constructor arguments (ValueError naming the argument)."""
    if not isinstance(target, str) or not target:
        raise ValueError("target: expected a non-empty 'host:port' string")
    return ClientConfig(
        target=target,
        timeout_s=_check_timeout(timeout, ValueError),
        metadata=channel.call_metadata(token),
        credentials=channel.credentials(root_certificates, private_key, certificate_chain),
        options=channel.channel_options(channel_options),
        retry=RetryPolicy(
            max_retries=max_retries,
            initial_backoff_s=initial_backoff_s,
            max_backoff_s=max_backoff_s,
        ),
    )
