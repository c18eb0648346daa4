"""Errors at the HTTP door: one gRPC status, one HTTP status, one OpenAI-style body.

Every failure the core raises (RollwireError, a replica's refusal passed through) becomes
`{"error": {"message", "type", "param", "code", "reason"}}` with the HTTP status its gRPC code
maps to below, as vLLM's server answers (`code` is the HTTP status, `type` its name), plus
rollwire's stable `reason`. RESOURCE_EXHAUSTED and UNAVAILABLE carry `Retry-After` when the
core hinted a delay. Only a failure the core itself calls INTERNAL or UNKNOWN is a 5xx of
the 500 kind: a caller's mistake is always a 4xx.
"""

from __future__ import annotations

import math

import grpc
from fastapi.responses import JSONResponse

from rollwire.common.errors import RollwireError
from rollwire.common.reasons import Reason

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
"""gRPC code -> HTTP status; INTERNAL, UNKNOWN and DATA_LOSS are 500."""
BY_REASON: dict[str, int] = {
    Reason.BODY_TOO_LARGE: 413,
    Reason.VERSION_CONFLICT: 409,
    Reason.VERSION_NOT_MONOTONIC: 409,
}
"""Reasons whose HTTP status is more precise than their code's."""
TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    499: "CancelledError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
    504: "TimeoutError",
}


class HttpError(RollwireError):
    """A refusal decided at the door, with the request field it is about (`param`)."""

    def __init__(self, code: grpc.StatusCode, message: str, *, reason: str, param: str | None = None) -> None:
        super().__init__(message, reason=reason, code=code)
        self.param = param


def unsupported(field: str, why: str) -> HttpError:
    """400 for a field the core cannot honour, naming it."""
    return HttpError(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"{field}: {why}",
        reason=Reason.UNSUPPORTED_FIELD,
        param=field,
    )


def http_status(err: RollwireError) -> int:
    return BY_REASON.get(err.reason, HTTP_STATUS.get(err.code, 500))


def error_response(err: RollwireError) -> JSONResponse:
    """The HTTP answer for `err`."""
    status = http_status(err)
    body = {
        "error": {
            "message": err.message,
            "type": TYPES.get(status, "Error"),
            "param": getattr(err, "param", None),
            "code": status,
            "reason": err.reason or err.code.name,
        }
    }
    headers = {}
    if err.retry_after_s is not None and status in (429, 503):
        headers["Retry-After"] = str(max(1, math.ceil(err.retry_after_s)))
    return JSONResponse(body, status_code=status, headers=headers)
