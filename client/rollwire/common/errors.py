"""Error vocabulary shared by every rollwire service and the SDK.

Servers raise `RollwireError(code, message, reason)`; the gRPC layer turns it into a
status with a `google.rpc.ErrorInfo` (domain "rollwire.dev", a stable machine-readable
`reason`) and, for RESOURCE_EXHAUSTED/UNAVAILABLE, a `google.rpc.RetryInfo`. The SDK turns
statuses back into the typed exceptions below. Messages are sentences a person can act on.
"""

from __future__ import annotations

import grpc

ERROR_DOMAIN = "rollwire.dev"


class RollwireError(Exception):
    """A failure with a gRPC status code, a human sentence and a stable reason."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(
        self,
        message: str,
        *,
        reason: str = "",
        code: grpc.StatusCode | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason
        self.retry_after_s = retry_after_s
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


class InvalidArgument(RollwireError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(RollwireError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(RollwireError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class AlreadyExists(RollwireError):
    code = grpc.StatusCode.ALREADY_EXISTS


class ResourceExhausted(RollwireError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(RollwireError):
    code = grpc.StatusCode.UNAVAILABLE


class Unauthenticated(RollwireError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(RollwireError):
    code = grpc.StatusCode.PERMISSION_DENIED


class DeadlineExceeded(RollwireError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(RollwireError):
    code = grpc.StatusCode.CANCELLED


class Internal(RollwireError):
    code = grpc.StatusCode.INTERNAL


_BY_CODE: dict[grpc.StatusCode, type[RollwireError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        FailedPrecondition,
        AlreadyExists,
        ResourceExhausted,
        Unavailable,
        Unauthenticated,
        PermissionDenied,
        DeadlineExceeded,
        Cancelled,
        Internal,
    )
}


def error_class(code: grpc.StatusCode) -> type[RollwireError]:
    """The typed exception for a status code (RollwireError for the rest)."""
    return _BY_CODE.get(code, RollwireError)


def to_status(err: RollwireError) -> grpc.Status:
    """A grpc.Status carrying ErrorInfo (and RetryInfo when there is a hint)."""
    from google.protobuf import any_pb2, duration_pb2
    from google.rpc import error_details_pb2, status_pb2
    from grpc_status import rpc_status

    details = []
    info = error_details_pb2.ErrorInfo(reason=err.reason or err.code.name, domain=ERROR_DOMAIN)
    packed = any_pb2.Any()
    packed.Pack(info)
    details.append(packed)
    if err.retry_after_s is not None:
        delay = duration_pb2.Duration()
        delay.FromMilliseconds(int(err.retry_after_s * 1000))
        retry = any_pb2.Any()
        retry.Pack(error_details_pb2.RetryInfo(retry_delay=delay))
        details.append(retry)
    proto = status_pb2.Status(code=err.code.value[0], message=err.message, details=details)
    return rpc_status.to_status(proto)


def from_rpc_error(exc: grpc.RpcError) -> RollwireError:
    """The typed exception for an RpcError, with reason and retry hint when sent."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    message = (exc.details() if hasattr(exc, "details") else None) or str(exc)
    reason, retry_after = _parse_details(exc)
    return error_class(code)(message, reason=reason, code=code, retry_after_s=retry_after)


def _parse_details(exc: grpc.RpcError) -> tuple[str, float | None]:
    from google.rpc import error_details_pb2

    trailers = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    raw = None
    for key, value in trailers or ():
        if key == "grpc-status-details-bin":
            raw = value
    if not raw:
        return "", None
    from google.rpc import status_pb2

    status = status_pb2.Status.FromString(raw)
    reason, retry_after = "", None
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reason = info.reason
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
            retry_after = retry.retry_delay.ToMilliseconds() / 1000
    return reason, retry_after


def clip(text: str, n: int = 64) -> str:
    """A client's string as an error message may echo it: repr'd (control characters
    escaped) and cut to its first `n` characters, with the full length when cut."""
    text = str(text)
    return repr(text) if len(text) <= n else f"{text[:n]!r}... ({len(text)} characters)"
