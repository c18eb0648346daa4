"""GeneratorService at the proxy: the same contract as a replica, spread over many.

Invariants: the proxy answers every accepted request exactly once, complete or with an
error status, within its deadline (failover.py); a refusal decided by a replica reaches the
client unchanged (relay.py); the request id travels to the replicas as `x-request-id`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import structlog

from rollwire.common.errors import RollwireError, to_status
from rollwire.common.logs import get_logger, request_id_from
from rollwire.server import __version__
from rollwire.server.proxy.config import ProxyConfig
from rollwire.server.proxy.dispatch import Dispatcher
from rollwire.server.proxy.failover import GroupRun
from rollwire.server.proxy.fanout import FanOut
from rollwire.server.proxy.metrics import ProxyMetrics
from rollwire.server.proxy.relay import Relay
from rollwire.server.proxy.replicas import ReplicaSet
from rollwire.server.proxy.spool import Spool
from rollwire.v1 import generator_pb2 as pb
from rollwire.v1 import generator_pb2_grpc

log = get_logger(__name__)


class ProxyServicer(generator_pb2_grpc.GeneratorServiceServicer):
    def __init__(self, config: ProxyConfig, replicas: ReplicaSet, dispatcher: Dispatcher, spool: Spool,
                 fanout: FanOut, metrics: ProxyMetrics, proxy_id: str) -> None:
        self.config, self.replicas, self.dispatcher, self.spool = config, replicas, dispatcher, spool
        self.fanout, self.metrics, self.proxy_id = fanout, metrics, proxy_id

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        rid = request_id_from(context.invocation_metadata(), request.request_id)
        structlog.contextvars.bind_contextvars(request_id=rid)
        start, code = time.monotonic(), grpc.StatusCode.OK
        remaining = context.time_remaining()
        limit = self.config.routing.request_timeout_s
        timeout = limit if remaining is None else min(remaining, limit)
        run = GroupRun(request, rid, start + timeout, self.dispatcher, self.replicas, self.config.routing, self.metrics)
        try:
            async with contextlib.aclosing(run.events()) as events:
                async for message in events:
                    yield message
        except RollwireError as err:
            code = err.code
            log.info("generate_failed", code=code.name, reason=err.reason, error=err.message)
            await context.abort_with_status(to_status(err))
        except Relay as relay:
            code = relay.code
            log.info("generate_refused_by_replica", code=code.name, error=relay.details)
            await relay.abort(context)
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        finally:
            policy = self.metrics.policy
            self.metrics.requests.labels(policy, code.name).inc()
            self.metrics.latency.labels(policy).observe(time.monotonic() - start)
            structlog.contextvars.unbind_contextvars("request_id")

    async def PushAdapter(self, request_iterator, context: grpc.aio.ServicerContext) -> pb.PushAdapterResponse:
        rid = request_id_from(context.invocation_metadata())
        structlog.contextvars.bind_contextvars(request_id=rid)
        try:
            upload = await self.spool.receive(request_iterator)
            return await self.fanout.publish(upload, rid)
        except RollwireError as err:
            log.info("adapter_push_refused", code=err.code.name, reason=err.reason, error=err.message)
            await context.abort_with_status(to_status(err))
        except Relay as relay:
            log.info("adapter_push_refused_by_replicas", code=relay.code.name, error=relay.details)
            await relay.abort(context)
        finally:
            structlog.contextvars.unbind_contextvars("request_id")

    async def GetStatus(self, request: pb.GetStatusRequest, context) -> pb.GetStatusResponse:
        return self.status()

    def status(self) -> pb.GetStatusResponse:
        """The proxy as one big replica: what some routable replica serves, the strictest
        limits of any replica (a client keeping to them is served by every one), and each
        replica's own state."""
        members = self.replicas.all()
        routable = self.replicas.routable()
        adapters: dict[str, set[int]] = {}
        for replica in routable:
            for name, versions in replica.versions.items():
                adapters.setdefault(name, set()).update(versions)
        return pb.GetStatusResponse(
            role="proxy",
            replica=self.proxy_id,
            model_fingerprint=self.replicas.fingerprint,
            engine=",".join(sorted({r.engine for r in members if r.engine})),
            adapters=[pb.LoadedAdapter(name=n, versions=sorted(v)) for n, v in sorted(adapters.items())],
            in_flight=sum(r.in_flight for r in members),
            queue_depth=self.dispatcher.queued(),
            limits=self._limits([r.limits for r in members if r.limits is not None]),
            replicas=[r.status() for r in members],
            server_version=__version__,
        )

    def _limits(self, limits: list[pb.Limits]) -> pb.Limits:
        spool_max = self.config.spool.max_adapter_bytes
        if not limits:
            return pb.Limits(max_adapter_bytes=spool_max)
        return pb.Limits(
            max_n=min(x.max_n for x in limits),
            max_new_tokens=min(x.max_new_tokens for x in limits),
            max_prompt_tokens=min(x.max_prompt_tokens for x in limits),
            max_adapter_bytes=min([spool_max] + [x.max_adapter_bytes for x in limits]),
            adapter_window=min(x.adapter_window for x in limits),
        )
