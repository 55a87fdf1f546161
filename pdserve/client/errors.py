"""The SDK's exceptions: one class per gRPC status the pdserve API documents.

Every failed call raises a `PDServeError` carrying the gRPC status code and the server's message.
Statuses the API names get their own subclass, so callers can write `except Unavailable:`;
any other status raises the base class. `InvalidArgument` is also a `ValueError`, because the
client raises it itself for arguments it can tell are invalid before sending anything.
"""

from __future__ import annotations

from types import MappingProxyType

import grpc

RETRY_AFTER_KEY = "retry-after-ms"
"""Trailing metadata the router sets on RESOURCE_EXHAUSTED: milliseconds to wait first."""


class PDServeError(Exception):
    """A pdserve call failed with gRPC status `code`; `message` is the server's explanation.
    `retry_after_s`: how long the server asked to wait before trying again, if it did."""

    def __init__(self, code: grpc.StatusCode, message: str,
                 retry_after_s: float | None = None) -> None:
        super().__init__(code, message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


class _FixedCodeError(PDServeError):
    """A PDServeError subclass bound to one status code: built from the message alone."""

    CODE: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str) -> None:
        super().__init__(self.CODE, message)


class InvalidArgument(_FixedCodeError, ValueError):
    """The request is malformed or out of range; retrying it unchanged cannot succeed."""

    CODE = grpc.StatusCode.INVALID_ARGUMENT


class ResourceExhausted(_FixedCodeError):
    """The server is over capacity (its queues are full); back off before trying again."""

    CODE = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(_FixedCodeError):
    """No healthy server or worker could take the request (retried automatically)."""

    CODE = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(_FixedCodeError):
    """The call's deadline (`timeout`) passed before it completed."""

    CODE = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(_FixedCodeError):
    """The call was cancelled (by the client or the server)."""

    CODE = grpc.StatusCode.CANCELLED


class Unauthenticated(_FixedCodeError):
    """The bearer token is missing or wrong."""

    CODE = grpc.StatusCode.UNAUTHENTICATED


class Internal(_FixedCodeError):
    """The server failed, or broke the protocol (e.g. a stream that ends without a finish)."""

    CODE = grpc.StatusCode.INTERNAL


_BY_CODE: MappingProxyType[grpc.StatusCode, type[_FixedCodeError]] = MappingProxyType(
    {
        cls.CODE: cls
        for cls in (
            InvalidArgument,
            ResourceExhausted,
            Unavailable,
            DeadlineExceeded,
            Cancelled,
            Unauthenticated,
            Internal,
        )
    }
)


def error_for(code: grpc.StatusCode, message: str,
              retry_after_s: float | None = None) -> PDServeError:
    """The exception for a status: its subclass when the API names it, else the base class."""
    cls = _BY_CODE.get(code)
    err = cls(message) if cls is not None else PDServeError(code, message)
    err.retry_after_s = retry_after_s
    return err


def from_rpc_error(err: grpc.RpcError) -> PDServeError:
    """Converts an error raised by grpc (sync or aio) into the SDK's exception."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else None
    return error_for(code or grpc.StatusCode.UNKNOWN, details or str(err), _retry_after(err))


def _retry_after(err: grpc.RpcError) -> float | None:
    """The server's retry hint (`retry-after-ms` trailing metadata), in seconds."""
    try:
        trailing = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    except Exception:  # noqa: BLE001 - a call that never started has no metadata
        return None
    for key, value in trailing or ():
        if key == RETRY_AFTER_KEY:
            try:
                ms = float(value)
            except (TypeError, ValueError):
                return None
            return ms / 1000.0 if 0.0 <= ms < 3.6e6 else None
    return None
