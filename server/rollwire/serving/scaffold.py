"""The scaffold every rollwire server process stands on: one gRPC server, health, reflection,
the plaintext probe port, Prometheus, the ready file and serve-until-signal.

The generator and the proxy differ only in the servicers they add; everything here is the
same for both, so a change to server options (message sizes, keepalive) or to shutdown order
happens once. Shutdown order is an invariant: health goes NOT_SERVING first (load balancers
stop sending), then the server drains for `grace` seconds, then the probe and metrics stop.
"""

from __future__ import annotations

import asyncio
import gc
import os
import resource
import signal
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from http.server import HTTPServer
from typing import TypeVar

import grpc
from grpc_health.v1 import _async as health_aio  # pyright: ignore[reportAttributeAccessIssue]  # grpc's stubs lack it; it exists at run time
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from rollwire.common.keepalive import DEFAULT as DEFAULT_KEEPALIVE
from rollwire.common.keepalive import Keepalive
from rollwire.runtime.durable import write_ready_file
from rollwire.runtime.logs import get_logger
from rollwire.runtime.metrics import serve_metrics
from rollwire.runtime.security import (
    TlsSection,
    TokenAuth,
    add_port,
    interceptors,
    start_health_port,
    warn_if_exposed,
)
from rollwire.serving.config import ConnectionsSection, ServerConfig

log = get_logger(__name__)
C = TypeVar("C", bound=ServerConfig)

SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", 8 << 20),  # room to refuse an oversized chunk ourselves
    ("grpc.max_send_message_length", 8 << 20),
    ("grpc.so_reuseport", 0),
]
"""Options of every rollwire server besides keepalive (`server_options` adds it)."""


NOFILE_SHARE = 4
"""The gRPC port holds at most 1/NOFILE_SHARE of the process's soft file-descriptor limit."""


def server_options(
    keepalive: Keepalive = DEFAULT_KEEPALIVE, connections: ConnectionsSection | None = None
) -> list[tuple[str, int]]:
    """SERVER_OPTIONS plus keepalive (the server pings silent clients and accepts the pings of
    rollwire channels: rollwire.common.keepalive states the bound this gives) and the port's
    connection budget and handshake deadline."""
    c = connections or ConnectionsSection()
    budget = [
        ("grpc.max_allowed_incoming_connections", connection_budget(c.max_connections)),
        ("grpc.server_handshake_timeout_ms", int(c.handshake_timeout_s * 1000)),
    ]
    return [*SERVER_OPTIONS, *keepalive.server_options(), *budget]


def connection_budget(configured: int) -> int:
    """The gRPC port's connection cap: `configured`, at most a quarter of the soft RLIMIT_NOFILE."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return configured
    return max(1, min(configured, soft // NOFILE_SHARE))


@dataclass
class Endpoint:
    """A listening server process: its gRPC server, health, probe and metrics."""

    server: grpc.aio.Server
    health: health_aio.HealthServicer
    port: int
    metrics_server: HTTPServer
    metrics_port: int
    probe_server: grpc.aio.Server | None = None
    auth: TokenAuth | None = None
    """The tokens the server checks (None: auth is off); handlers ask it a call's role."""

    async def start(self, services: Iterable[str], host: str, tls: TlsSection) -> None:
        """Register health and reflection for `services`, start serving, open the probe port."""
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection([*services, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        await self.server.start()
        self.probe_server = await start_health_port(self.health, host, tls)

    async def set_health(self, service: str, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set(service, status)

    async def stop(self, grace: float) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        if self.probe_server:
            await self.probe_server.stop(0)
        self.metrics_server.shutdown()


def listen(
    role: str, config: ServerConfig, registry: CollectorRegistry, tenants: Iterable[tuple[str, Mapping[str, str]]] = ()
) -> Endpoint:
    """Serve metrics, create the gRPC server with the config's auth, TLS and keepalive, and bind
    it to host:port (not started yet).

    Refuses to run, with a sentence, when the port cannot be bound; warns loudly when a
    non-loopback bind has neither auth nor TLS. `tenants` (a proxy's) are (name, {role: token
    file}) pairs whose tokens are accepted for that tenant only.
    """
    host, auth, tls = config.host, config.auth, config.tls
    metrics_server = serve_metrics(host, config.metrics_port, registry)
    options = server_options(config.keepalive.keepalive(), config.connections)
    token_auth = TokenAuth.from_config(auth, tenants)
    server = grpc.aio.server(options=options, interceptors=interceptors(token_auth))
    bound = add_port(server, f"{host}:{config.port}", tls)
    if bound == 0:
        metrics_server.shutdown()
        raise SystemExit(f"cannot listen on {host}:{config.port}; is the port in use?")
    warn_if_exposed(role, host, bound, auth, tls, metrics_server.server_port)
    return Endpoint(
        server, health_aio.HealthServicer(), bound, metrics_server, metrics_server.server_port, auth=token_auth
    )


@dataclass
class Running:
    """A started server process: its endpoint, plus (in subclasses) the parts tests may inspect.

    `stop` drains the endpoint first (the shutdown order above), then `close`s the rest."""

    endpoint: Endpoint
    port: int = field(init=False)
    metrics_port: int = field(init=False)

    def __post_init__(self) -> None:
        self.port, self.metrics_port = self.endpoint.port, self.endpoint.metrics_port

    async def stop(self, grace: float) -> None:
        await self.endpoint.stop(grace)
        await self.close()

    async def close(self) -> None:
        """What a subclass releases once no request runs any more."""

    def ready(self) -> dict:
        """What the ready file tells a supervisor: the ports this server listens on."""
        return {"port": self.port, "metrics_port": self.metrics_port}


async def serve(
    role: str,
    running: Running,
    config: ServerConfig,
    ready_file: str | None,
    leave: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM, then `leave` (e.g. deregister), stop taking work and let
    in-flight requests finish within config.grace_seconds."""

    async def on_stop() -> None:
        log.info(f"{role}_stopping", grace_seconds=config.grace_seconds)
        if leave is not None:
            await leave()
        await running.stop(config.grace_seconds)

    await serve_until_signal(ready_file, running.ready(), on_stop)


async def serve_until_signal(ready_file: str | None, ready: dict, on_stop: Callable[[], Awaitable[None]]) -> None:
    """Write the ready file, wait for SIGINT/SIGTERM, then run `on_stop` (the graceful part)."""
    if ready_file:
        write_ready_file(ready_file, {**ready, "pid": os.getpid()})
    if not gc.isenabled():  # paused for the start by serving/command.py: what exists now lives as long as we do
        gc.freeze()  # the start's few thousand garbage cycles (~MBs) stay too, once
        gc.enable()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await on_stop()
