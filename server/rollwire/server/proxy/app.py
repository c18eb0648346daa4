"""Assembling and running the routing proxy: replica set, dispatcher, gRPC server, metrics.

Invariants: the proxy serves GeneratorService, AdminService, gRPC health and reflection on
one port, with the same bearer-token roles and TLS as a generator (security.py); health for
GeneratorService is SERVING exactly while some replica is routable;
on SIGTERM it stops taking requests, lets in-flight groups finish for `grace_seconds`,
then closes its replica connections.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from rollwire.common.logs import get_logger
from rollwire.server.proxy.admin import AdminServicer
from rollwire.server.proxy.config import ProxyConfig
from rollwire.server.proxy.discovery import DnsDiscovery
from rollwire.server.proxy.dispatch import Dispatcher
from rollwire.server.proxy.fanout import FanOut
from rollwire.server.proxy.metrics import ProxyMetrics
from rollwire.server.proxy.policies import make_policy
from rollwire.server.proxy.replicas import SERVICE, ReplicaSet
from rollwire.server.proxy.servicer import ProxyServicer
from rollwire.server.proxy.spool import Spool
from rollwire.server.proxy.upstream import Upstream
from rollwire.server.security import add_port, interceptors, start_health_port, warn_if_exposed
from rollwire.v1 import admin_pb2, admin_pb2_grpc, generator_pb2_grpc

log = get_logger(__name__)
ADMIN_SERVICE = admin_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", 8 << 20),  # room to refuse an oversized chunk ourselves
    ("grpc.max_send_message_length", 8 << 20),
    ("grpc.so_reuseport", 0),
]


@dataclass
class RunningProxy:
    """A started proxy: its ports and the pieces tests may inspect."""

    server: grpc.aio.Server
    servicer: ProxyServicer
    replicas: ReplicaSet
    health: health.aio.HealthServicer
    port: int
    metrics_port: int
    metrics_server: object
    spool_dir: Path
    owns_spool: bool
    probe_server: grpc.aio.Server | None = None
    tasks: list[asyncio.Task] = field(default_factory=list)

    async def stop(self, grace: float) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        if self.probe_server:
            await self.probe_server.stop(0)
        for task in self.tasks:
            task.cancel()
        await self.replicas.close()
        self.metrics_server.shutdown()
        if self.owns_spool:
            shutil.rmtree(self.spool_dir, ignore_errors=True)


async def start_proxy(config: ProxyConfig) -> RunningProxy:
    """Listen at once; replicas join as their health checks and catch-ups succeed."""
    routing = config.routing
    metrics = ProxyMetrics(config.policy)
    metrics_server, _ = start_http_server(config.metrics_port, addr=config.host, registry=metrics.registry)
    owns_spool = not config.spool.dir
    spool_dir = Path(config.spool.dir or tempfile.mkdtemp(prefix="rollwire-spool-"))
    spool_dir.mkdir(parents=True, exist_ok=True)
    s = config.spool
    spool = Spool(spool_dir, max_bytes=s.max_bytes, keep_versions=s.keep_versions, max_adapter_bytes=s.max_adapter_bytes)
    health_servicer = health.aio.HealthServicer()
    serving = _ServingFlag(health_servicer)
    dispatcher: Dispatcher | None = None

    def on_change() -> None:
        serving.update(bool(replicas.routable()))
        if dispatcher is not None:
            dispatcher.wake()

    replicas = ReplicaSet(config, spool, metrics, on_change, Upstream.from_config(config.upstream))
    policy = make_policy(
        config.policy, affinity_load_factor=routing.affinity_load_factor, affinity_min_gap=routing.affinity_min_gap
    )
    dispatcher = Dispatcher(replicas, policy, routing, metrics, config.fairness)
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors(config.auth))
    port = add_port(server, f"{config.host}:{config.port}", config.tls)
    if port == 0:
        raise SystemExit(f"cannot listen on {config.host}:{config.port}; is the port in use?")
    warn_if_exposed("proxy", config.host, port, config.auth, config.tls, metrics_server.server_port)
    proxy_id = config.proxy_id or f"proxy@{config.host}:{port}"
    fanout = FanOut(spool, replicas, config.health, routing, metrics)
    servicer = ProxyServicer(config, replicas, dispatcher, spool, fanout, metrics, proxy_id)
    generator_pb2_grpc.add_GeneratorServiceServicer_to_server(servicer, server)
    admin_pb2_grpc.add_AdminServiceServicer_to_server(AdminServicer(replicas), server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([SERVICE, ADMIN_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set(SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
    probe_server = await start_health_port(health_servicer, config.host, config.tls)
    for address in config.generators:
        replicas.add(address, "static")
    running = RunningProxy(server, servicer, replicas, health_servicer, port, metrics_server.server_port, metrics_server,
                           spool_dir, owns_spool, probe_server)
    if config.discover:
        discovery = DnsDiscovery(config.discover, config.discover_interval_s, lambda found: replicas.reconcile("dns", found))
        running.tasks.append(asyncio.create_task(discovery.run()))
    log.info("proxy_ready", proxy=proxy_id, port=port, metrics_port=running.metrics_port, policy=config.policy,
             generators=config.generators, discover=config.discover, spool=str(spool_dir))
    return running


class _ServingFlag:
    """Mirrors "some replica is routable" into gRPC health for GeneratorService."""

    def __init__(self, servicer: health.aio.HealthServicer) -> None:
        self.servicer, self.value = servicer, False
        self._tasks: set[asyncio.Task] = set()

    def update(self, value: bool) -> None:
        if value != self.value:
            self.value = value
            status = health_pb2.HealthCheckResponse.SERVING if value else health_pb2.HealthCheckResponse.NOT_SERVING
            task = asyncio.get_running_loop().create_task(self.servicer.set(SERVICE, status))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)


async def run_proxy(config: ProxyConfig, ready_file: str | None = None) -> None:
    """Serve until SIGINT/SIGTERM, then stop taking work and let in-flight groups finish."""
    from rollwire.server.app import write_ready_file

    running = await start_proxy(config)
    if ready_file:
        write_ready_file(ready_file, {"port": running.port, "metrics_port": running.metrics_port, "pid": os.getpid()})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("proxy_stopping", grace_seconds=config.grace_seconds)
    await running.stop(config.grace_seconds)
