"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` plus an HTTP status.

Owns the one mapping from the router's gRPC statuses (`FlowError.code`) to HTTP statuses.
`RequestError`, the validation error that names the offending request field (a 400), is the
one both public APIs share (`router/validation.py`).
"""

from __future__ import annotations

import math

import grpc

from router.validation import RequestError

# gRPC status -> (HTTP status, OpenAI error type). 499 is nginx's "client closed request".
_FROM_GRPC: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.ABORTED: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}
_SERVER_ERROR = (500, "server_error")


class ApiError(Exception):
    """Ends an HTTP request with `status` and an OpenAI error body."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(exc: RequestError) -> ApiError:
    return ApiError(400, str(exc), "invalid_request_error", exc.param)


def from_status(code: grpc.StatusCode, message: str) -> ApiError:
    status, type_ = _FROM_GRPC.get(code, _SERVER_ERROR)
    return ApiError(status, message, type_, None, code.name.lower())


def too_many_requests(message: str, retry_after_s: float) -> ApiError:
    """429 with `Retry-After` (whole seconds, at least 1: what HTTP clients understand)."""
    return ApiError(429, message, "rate_limit_error", None, "resource_exhausted",
                    {"Retry-After": str(max(math.ceil(retry_after_s), 1))})


def request_timeout(what: str, seconds: float) -> ApiError:
    return ApiError(408, f"the request {what} did not arrive within {seconds:g}s",
                    "invalid_request_error", None, "request_timeout")


def body_too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {limit} bytes",
                    "invalid_request_error", None, "request_too_large")


def unauthenticated() -> ApiError:
    return ApiError(401, "missing or invalid bearer token (Authorization: Bearer <token>)",
                    "authentication_error", None, "invalid_api_key")


def model_not_found(model: str, served: str) -> ApiError:
    return ApiError(404, f"model {model!r} is not served here (serving {served!r})",
                    "not_found_error", "model", "model_not_found")
