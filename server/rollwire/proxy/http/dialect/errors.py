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
import re

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
    405: "MethodNotAllowedError",
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
    """A refusal in the door's words, with the request field it is about (`param`): decided
    at the door, or the core's refusal reworded (vocabulary.py; `relayed` when a replica
    decided it). `status` overrides the HTTP status the code maps to (405 for a method a
    route does not take, which no gRPC code means)."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        *,
        reason: str,
        param: str | None = None,
        retry_after_s: float | None = None,
        status: int | None = None,
    ) -> None:
        super().__init__(message, reason=reason, code=code, retry_after_s=retry_after_s)
        self.param = param
        self.status = status
        self.relayed = False


def unsupported(field: str, why: str) -> HttpError:
    """400 for a field the core cannot honour, naming it."""
    return HttpError(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"{field}: {why}",
        reason=Reason.UNSUPPORTED_FIELD,
        param=field,
    )


def http_status(err: RollwireError) -> int:
    return getattr(err, "status", None) or BY_REASON.get(err.reason, HTTP_STATUS.get(err.code, 500))


_BRANCH = re.compile(r"(str|int|float|bool|dict|list|none|[a-z-]+\[.*\])")
"""A pydantic location's segment that names a union's branch, not a field."""


def field_name(loc: str) -> str:
    """A pydantic location as the field a caller wrote: `messages.0.content` is
    `messages[0].content`, and a union's branch names (`str`, `list[int]`,
    `literal['none','auto']`) are no fields."""
    out: list[str] = []
    for part in re.split(r"\.(?![^\[]*\])", loc):
        if part.isdigit() and out:
            out[-1] += f"[{part}]"
        elif not _BRANCH.fullmatch(part):
            out.append(part)
    return ".".join(out) or loc


def error_response(err: RollwireError) -> JSONResponse:
    """The HTTP answer for `err`."""
    status = http_status(err)
    param, message = getattr(err, "param", None), err.message
    if param:
        named = field_name(param)
        message, param = (named + message[len(param) :] if message.startswith(param) else message), named
    body = {
        "error": {
            "message": message,
            "type": TYPES.get(status, "Error"),
            "param": param,
            "code": status,
            "reason": err.reason or err.code.name,
        }
    }
    headers = {}
    if err.retry_after_s is not None and status in (429, 503):
        headers["Retry-After"] = str(max(1, math.ceil(err.retry_after_s)))
    return JSONResponse(body, status_code=status, headers=headers)
