"""Passing a replica's error status through the proxy unchanged.

A client cannot tell the proxy from a replica, so a refusal the replica decided (a bad
request, an unknown adapter, a push for the wrong base model) reaches the client with the
replica's code, sentence and `google.rpc` details (ErrorInfo reason, RetryInfo, ...), the
sentence in the caller's words (`scoped`: a tenant's, tenants.Scope.scrub) in both places it
travels.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

from rollwire.common.errors import DETAILS_KEY, RollwireError, error_class


class PassThrough(Exception):
    """A replica's final status, to be sent to the client as it is."""

    def __init__(self, exc: grpc.aio.AioRpcError) -> None:
        super().__init__(exc.details())
        self.code = exc.code()
        self.details = exc.details() or ""
        self.trailers = tuple((k, v) for k, v in (exc.trailing_metadata() or ()) if k == DETAILS_KEY)

    def scoped(self, scrub: Callable[[str], str]) -> PassThrough:
        """The same status in one caller's words (tenants.Scope.scrub), its sentence and the
        `google.rpc.Status` detail that repeats it rewritten together, so neither carries what
        the other leaves out; a detail that does not parse is dropped, never sent as it came."""
        from google.rpc import status_pb2

        self.details = scrub(self.details)
        trailers = []
        for key, value in self.trailers:
            try:
                status = status_pb2.Status.FromString(value if isinstance(value, bytes) else value.encode())
            except ValueError:
                continue
            status.message = self.details
            trailers.append((key, status.SerializeToString()))
        self.trailers = tuple(trailers)
        return self

    async def abort(self, context: grpc.aio.ServicerContext) -> None:
        await context.abort(self.code, self.details, self.trailers)

    def error(self) -> RollwireError:
        """The same status as a typed error, its ErrorInfo reason and RetryInfo hint read from
        the details the replica sent (for a door that speaks no gRPC: the HTTP edge)."""
        from google.rpc import error_details_pb2, status_pb2

        reason, retry_after = "", None
        for _, value in self.trailers:
            try:
                status = status_pb2.Status.FromString(value if isinstance(value, bytes) else value.encode())
            except ValueError:
                continue
            for detail in status.details:
                if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):  # pyright: ignore[reportArgumentType]  # upb descriptors at run time
                    info = error_details_pb2.ErrorInfo()
                    detail.Unpack(info)
                    reason = info.reason
                elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):  # pyright: ignore[reportArgumentType]  # upb descriptors at run time
                    retry = error_details_pb2.RetryInfo()
                    detail.Unpack(retry)
                    retry_after = retry.retry_delay.ToMilliseconds() / 1000
        return error_class(self.code)(self.details, reason=reason, code=self.code, retry_after_s=retry_after)
