"""Error vocabulary shared by every rollwire service and the SDK.

Servers raise `RollwireError(code, message, reason)`; `to_status` turns it into a status
with a `google.rpc.ErrorInfo` (domain "rollwire.dev", a stable machine-readable `reason`
from reasons.py) and, when the server hints a delay, a `google.rpc.RetryInfo`; the SDK
turns statuses back into the typed exceptions below (`from_rpc_error`). Both directions go
through grpc_status.rpc_status, so no code here builds or parses the trailing metadata by
hand. Messages are sentences a person can act on.
"""

from __future__ import annotations

import math
import operator
from typing import TYPE_CHECKING, TypeVar

import grpc

if TYPE_CHECKING:
    from google.protobuf.message import Message

M = TypeVar("M", bound="Message")
ERROR_DOMAIN = "rollwire.dev"
DETAILS_KEY = "grpc-status-details-bin"
"""The trailer in which grpc_status.rpc_status carries the google.rpc.Status (for pass-through)."""


_BY_CODE: dict[grpc.StatusCode, type[RollwireError]] = {}


class RollwireError(Exception):
    """A failure with a gRPC status code, a human sentence and a stable reason."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init_subclass__(cls, code: grpc.StatusCode | None = None, **kwargs) -> None:
        """`class X(RollwireError, code=...)` is the typed exception for that code (error_class)."""
        super().__init_subclass__(**kwargs)
        if code is not None:
            cls.code = code
            _BY_CODE.setdefault(code, cls)

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


class InvalidArgument(RollwireError, code=grpc.StatusCode.INVALID_ARGUMENT):
    """The request is malformed or out of bounds; fix it before sending it again."""


class NotFound(RollwireError, code=grpc.StatusCode.NOT_FOUND):
    """What the request names (an adapter, a version, a replica) is not there."""


class FailedPrecondition(RollwireError, code=grpc.StatusCode.FAILED_PRECONDITION):
    """The request is valid but the server's state refuses it (a version, the base model)."""


class AlreadyExists(RollwireError, code=grpc.StatusCode.ALREADY_EXISTS):
    """What the request would create is there already."""


class ResourceExhausted(RollwireError, code=grpc.StatusCode.RESOURCE_EXHAUSTED):
    """A limit or a full queue; `retry_after_s` carries the server's hint when it gave one."""


class Unavailable(RollwireError, code=grpc.StatusCode.UNAVAILABLE):
    """The server or a replica cannot serve now; the SDK retries it before any response."""


class Unauthenticated(RollwireError, code=grpc.StatusCode.UNAUTHENTICATED):
    """No bearer token, or one the server does not know."""


class PermissionDenied(RollwireError, code=grpc.StatusCode.PERMISSION_DENIED):
    """The token's role may not call this method."""


class DeadlineExceeded(RollwireError, code=grpc.StatusCode.DEADLINE_EXCEEDED):
    """The call's deadline, or a server-side wait's, passed first."""


class Cancelled(RollwireError, code=grpc.StatusCode.CANCELLED):
    """The call was cancelled (by the caller, or by a server shutting down)."""


class Unimplemented(RollwireError, code=grpc.StatusCode.UNIMPLEMENTED):
    """The server (or its engine) does not offer this method."""


class Internal(RollwireError, code=grpc.StatusCode.INTERNAL):
    """A server bug or an engine failure, named by its reason."""


def error_class(code: grpc.StatusCode) -> type[RollwireError]:
    """The typed exception for a status code (RollwireError for the rest)."""
    return _BY_CODE.get(code, RollwireError)


def to_status(err: RollwireError, *extra: Message) -> grpc.Status:
    """A grpc.Status carrying ErrorInfo, RetryInfo when there is a hint, then `extra` details
    (built by grpc_status.rpc_status, so code and message match the details by construction)."""
    from google.protobuf import any_pb2, duration_pb2
    from google.rpc import error_details_pb2, status_pb2
    from grpc_status import rpc_status

    details: list[Message] = [error_details_pb2.ErrorInfo(reason=err.reason or err.code.name, domain=ERROR_DOMAIN)]
    if err.retry_after_s is not None:
        delay = duration_pb2.Duration()
        delay.FromMilliseconds(int(err.retry_after_s * 1000))
        details.append(error_details_pb2.RetryInfo(retry_delay=delay))
    packed = []
    for detail in (*details, *extra):
        packed.append(any_pb2.Any())
        packed[-1].Pack(detail)
    proto = status_pb2.Status(code=err.code.value[0], message=err.message, details=packed)
    return rpc_status.to_status(proto)


def from_rpc_error(exc: grpc.RpcError) -> RollwireError:
    """The typed exception for an RpcError, with reason and retry hint when sent."""
    from google.rpc import error_details_pb2

    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    message = (exc.details() if hasattr(exc, "details") else None) or str(exc)
    info = status_detail(exc, error_details_pb2.ErrorInfo)
    retry = status_detail(exc, error_details_pb2.RetryInfo)
    retry_after = retry.retry_delay.ToMilliseconds() / 1000 if retry is not None else None
    return error_class(code)(message, reason=info.reason if info else "", code=code, retry_after_s=retry_after)


def status_detail(exc: grpc.RpcError, kind: type[M]) -> M | None:
    """The first `google.rpc.Status` detail of type `kind` an error carries, read by
    grpc_status.rpc_status; None when there is none, or when the details contradict the
    status's own code or message (then they are not this status's: nothing is trusted)."""
    from google.protobuf.message import DecodeError
    from grpc_status import rpc_status

    try:
        status = rpc_status.from_call(exc)  # type: ignore[arg-type]  (an RpcError raised by a call is a Call)
    except (AttributeError, ValueError, DecodeError):
        return None
    for detail in status.details if status is not None else ():
        if detail.Is(kind.DESCRIPTOR):
            value = kind()
            detail.Unpack(value)
            return value
    return None


def clip(text: str, n: int = 64) -> str:
    """A client's string as an error message may echo it: repr'd (control characters
    escaped) and cut to its first `n` characters, with the full length when cut."""
    text = str(text)
    return repr(text) if len(text) <= n else f"{text[:n]!r}... ({len(text)} characters)"


class RequestError(InvalidArgument, ValueError):
    """A request the SDK refuses before sending it; an InvalidArgument and a ValueError."""


def whole_number(name: str, value: object, low: int, high: int) -> int:
    """`value` as an int in [low, high] (bools and floats refused), or RequestError naming `name`."""
    if isinstance(value, bool):
        raise RequestError(f"{name} must be a whole number, got {value!r}")
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise RequestError(f"{name} must be a whole number, got {value!r}") from None
    if not low <= number <= high:
        raise RequestError(f"{name} must be between {low} and {high}, got {number}")
    return number


def finite_number(name: str, value: object) -> float:
    """`value` as a finite float (bools refused), or RequestError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"{name} must be a finite number, got {value!r}")
    return float(value)
