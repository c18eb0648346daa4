"""One accounting of generation requests, whichever door they came by (gRPC Generate, the
HTTP door's completions and chat completions).

Invariants:
- every request is counted exactly once in `rollwire_proxy_requests_total` with its final
  gRPC code (an HTTP error's code is the gRPC code its status maps from, errors.py), timed
  once in `request_duration_seconds` from its arrival to its last message, and, when the
  client caused its end, counted once in `client_errors_total`;
- the client caused an end when a replica's refusal was relayed (PassThrough, or the HTTP
  door's rewording of one, which says `relayed`), when the
  proxy refused it for how the client behaves (`CLIENT_BEHAVIOUR`: per-client limits, slow
  reading) or by a replica's own rule applied before forwarding (`REQUEST_RULES`: a prompt or
  group key no replica would take), or when the HTTP door refused it at its edge, before the core saw it, with a
  code a request can cause (`CLIENT_CAUSED`: the refusals a replica would relay to a gRPC
  caller: a malformed body, an unknown field, a model no adapter can be named);
- a request that ends by cancellation counts as CANCELLED; one that fails unexpectedly
  counts as UNKNOWN, never as OK.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import grpc

from rollwire.common.errors import RollwireError
from rollwire.common.retries import CLIENT_BEHAVIOUR, CLIENT_CAUSED, REQUEST_RULES
from rollwire.proxy.routing.passthrough import PassThrough
from rollwire.proxy.tenants import FLEET

if TYPE_CHECKING:
    from rollwire.proxy.metrics import ProxyMetrics


def outcome(exc: BaseException | None, edge: bool = False) -> tuple[grpc.StatusCode, bool]:
    """A request's final code, and whether the client caused it, from how it ended."""
    if exc is None:
        return grpc.StatusCode.OK, False
    if isinstance(exc, PassThrough):
        return exc.code, True
    if isinstance(exc, RollwireError):
        relayed = getattr(exc, "relayed", False)  # a replica's refusal, reworded by the HTTP door
        own = exc.reason in CLIENT_BEHAVIOUR or exc.reason in REQUEST_RULES
        return exc.code, relayed or own or (edge and exc.code in CLIENT_CAUSED)
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return grpc.StatusCode.CANCELLED, False
    return grpc.StatusCode.UNKNOWN, False


class RequestRecord:
    """One request's entry in the core metrics, closed exactly once.

    Used as a context manager around the request's handling; a handler that passes the
    request on (an HTTP stream, whose events outlive the route) calls `hand_over` and the
    new owner calls `close` when the request ends."""

    def __init__(self, metrics: ProxyMetrics, *, edge: bool = False) -> None:
        self.metrics = metrics
        self.start = time.monotonic()
        self.edge = edge
        """True while the request is at the HTTP door's edge (see the module docstring);
        the door sets it False as it hands the request to the core."""
        self.code: grpc.StatusCode | None = None
        self.tenant = FLEET
        """The `tenant` label it counts under (the door sets it from the caller's token)."""
        self._owned = True

    def close(self, exc: BaseException | None = None) -> None:
        if self.code is not None:
            return
        code, client = outcome(exc, self.edge)
        self.code = code
        metrics = self.metrics
        metrics.requests.labels(metrics.policy, code.name).inc()
        metrics.tenant_requests.labels(self.tenant, code.name).inc()
        metrics.latency.labels(metrics.policy).observe(time.monotonic() - self.start)
        if client:
            metrics.client_errors.labels(code.name).inc()

    def hand_over(self) -> RequestRecord:
        """The record, now closed by its new owner instead of the with-block."""
        self._owned = False
        return self

    def __enter__(self) -> RequestRecord:
        return self

    def __exit__(self, kind, exc, traceback) -> None:
        if self._owned or exc is not None:
            self.close(exc)
