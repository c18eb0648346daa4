"""Passing a replica's error status through the proxy unchanged.

A client cannot tell the proxy from a replica, so a refusal the replica decided (a bad
request, an unknown adapter, a push for the wrong base model) reaches the client with the
replica's code, sentence and `google.rpc` details (ErrorInfo reason, RetryInfo, ...).
"""

from __future__ import annotations

import grpc

from rollwire.common.errors import DETAILS_KEY


class Relay(Exception):
    """A replica's final status, to be sent to the client as it is."""

    def __init__(self, exc: grpc.aio.AioRpcError) -> None:
        super().__init__(exc.details())
        self.code = exc.code()
        self.details = exc.details() or ""
        self.trailers = tuple((k, v) for k, v in (exc.trailing_metadata() or ()) if k == DETAILS_KEY)

    async def abort(self, context: grpc.aio.ServicerContext) -> None:
        await context.abort(self.code, self.details, self.trailers)
