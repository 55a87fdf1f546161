"""How the client connects: channel options, TLS credentials and per-call metadata.

Shared by the sync and async clients so both talk to the router the same way.

Keepalive: the client pings every KEEPALIVE_TIME_MS while a call is open, so a dead connection
is noticed during a long prefill instead of hanging until the deadline. gRPC servers reject pings
more frequent than every 5 minutes by default; the router should accept them by setting
`grpc.http2.min_recv_ping_interval_without_data_ms` <= KEEPALIVE_TIME_MS (and
`grpc.keepalive_permit_without_calls` if it wants idle pings).
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import metadata
from typing import Any

import grpc

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""Send/receive limit: a long token-id prompt or a long logprob stream fits with room to spare."""
KEEPALIVE_TIME_MS = 30_000
KEEPALIVE_TIMEOUT_MS = 10_000


def _user_agent() -> str:
    try:
        return f"pdserve-client/{metadata.version('pdserve')}"
    except metadata.PackageNotFoundError:
        return "pdserve-client"


def channel_options(extra: Sequence[tuple[str, Any]] = ()) -> list[tuple[str, Any]]:
    """The client's channel options; entries in `extra` override defaults of the same name."""
    options = {
        "grpc.max_send_message_length": MAX_MESSAGE_BYTES,
        "grpc.max_receive_message_length": MAX_MESSAGE_BYTES,
        "grpc.keepalive_time_ms": KEEPALIVE_TIME_MS,
        "grpc.keepalive_timeout_ms": KEEPALIVE_TIMEOUT_MS,
        "grpc.keepalive_permit_without_calls": 0,
        "grpc.http2.max_pings_without_data": 0,  # keep pinging during a long silent prefill
        "grpc.primary_user_agent": _user_agent(),
    }
    options.update(dict(extra))
    return sorted(options.items())


def credentials(
    root_certificates: bytes | None,
    private_key: bytes | None = None,
    certificate_chain: bytes | None = None,
) -> grpc.ChannelCredentials | None:
    """TLS credentials when root certificates are given (mutual TLS with a key and chain), else
    None for a plaintext channel."""
    if root_certificates is None:
        if private_key is not None or certificate_chain is not None:
            raise ValueError("private_key/certificate_chain: need root_certificates for TLS")
        return None
    if (private_key is None) != (certificate_chain is None):
        raise ValueError("private_key and certificate_chain: give both or neither")
    return grpc.ssl_channel_credentials(root_certificates, private_key, certificate_chain)


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Metadata sent with every call: the bearer token when there is one."""
    if token is None:
        return ()
    if not isinstance(token, str) or not token or not token.isprintable() or " " in token:
        raise ValueError("token: must be a non-empty printable string without spaces")
    return (("authorization", f"Bearer {token}"),)


def open_channel(
    target: str, creds: grpc.ChannelCredentials | None, options: list[tuple[str, Any]]
) -> grpc.Channel:
    """A blocking-API channel to target."""
    if creds is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, creds, options=options)


def open_aio_channel(
    target: str, creds: grpc.ChannelCredentials | None, options: list[tuple[str, Any]]
) -> grpc.aio.Channel:
    """An asyncio channel to target; must be called inside the event loop that will use it."""
    if creds is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, creds, options=options)
