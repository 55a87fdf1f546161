"""The SDK's exceptions: one class per gRPC status the pdserve API documents.

Every failed call raises a `PDServeError` carrying the gRPC status code and the server's message.
Statuses the API names get their own subclass, so callers can write `except Unavailable:`;
any other status raises the base class. `InvalidArgument` is also a `ValueError`, because the
client raises it itself for arguments it can tell are invalid before sending anything.
"""

from __future__ import annotations

from types import MappingProxyType

import grpc


class PDServeError(Exception):
    """A pdserve call failed with gRPC status `code`; `message` is the server's explanation."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(code, message)
        self.code = code
        self.message = message

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


def error_for(code: grpc.StatusCode, message: str) -> PDServeError:
    """The exception for a status: its subclass when the API names it, else the base class."""
    cls = _BY_CODE.get(code)
    return cls(message) if cls is not None else PDServeError(code, message)


def from_rpc_error(err: grpc.RpcError) -> PDServeError:
    """Converts an error raised by grpc (sync or aio) into the SDK's exception."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else None
    return error_for(code or grpc.StatusCode.UNKNOWN, details or str(err))
