"""Assembling and running the routing proxy: replica set, dispatcher, gRPC server, metrics.

Invariants: the proxy serves GeneratorService, AdminService, gRPC health and reflection on
one port, with the same bearer-token roles and TLS as a generator (rollwire.serving); health for
GeneratorService is SERVING exactly while some replica is routable;
on SIGTERM it stops taking requests, lets in-flight groups finish for `grace_seconds`,
then closes its replica connections.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rollwire.proxy.admin import AdminServicer
from rollwire.proxy.config import ProxyConfig
from rollwire.proxy.core import ProxyCore, ProxyState
from rollwire.proxy.fleet.discovery import DnsDiscovery
from rollwire.proxy.fleet.replicas import SERVICE, ReplicaSet
from rollwire.proxy.metrics import ProxyMetrics
from rollwire.proxy.policies import make_policy
from rollwire.proxy.publish.fanout import FanOut
from rollwire.proxy.publish.peers import Peers
from rollwire.proxy.routing.dispatch import Dispatcher
from rollwire.proxy.routing.shares import Shares, check_spool_quota
from rollwire.proxy.servicer import ProxyServicer
from rollwire.proxy.spool import Spool
from rollwire.proxy.upstream import peer_dialer, upstream_dialer
from rollwire.runtime.logs import get_logger
from rollwire.runtime.security import TokenAuth
from rollwire.runtime.token_files import read_tokens
from rollwire.serving.scaffold import Endpoint, Running, listen, serve
from rollwire.v1 import admin_pb2, admin_pb2_grpc, generator_pb2_grpc

if TYPE_CHECKING:
    from rollwire.proxy.http.server import HttpServer

log = get_logger(__name__)
ADMIN_SERVICE = admin_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name


@dataclass
class RunningProxy(Running):
    """A started proxy: its endpoint and the pieces tests may inspect."""

    servicer: ProxyServicer
    replicas: ReplicaSet
    spool_dir: Path
    owns_spool: bool
    peers: Peers | None = None
    tasks: list[asyncio.Task] = field(default_factory=list)
    http: HttpServer | None = None
    """The HTTP front door (docs/http.md), when `http.port` is set."""

    @property
    def http_port(self) -> int | None:
        return self.http.port if self.http is not None else None

    def ready(self) -> dict:
        return super().ready() | ({"http_port": self.http.port} if self.http is not None else {})

    async def stop(self, grace: float) -> None:
        """Both doors stop taking requests at once; in-flight ones finish within `grace`."""
        if self.http is not None:
            await asyncio.gather(self.endpoint.stop(grace), self.http.stop())
            await self.close()
        else:
            await super().stop(grace)

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        self.servicer.state.fanout.close()
        await self.servicer.state.fanout.proofs.close()
        if self.peers is not None:
            await self.peers.close()
        await self.replicas.close()
        if self.owns_spool:
            shutil.rmtree(self.spool_dir, ignore_errors=True)


async def start_proxy(config: ProxyConfig) -> RunningProxy:
    """Listen at once; replicas join as their health checks and catch-ups succeed."""
    check_credentials(config)
    routing = config.routing
    metrics = ProxyMetrics(config.policy, tenants=[t.name for t in config.tenants])
    keepalive = config.keepalive.keepalive()
    endpoint = listen("proxy", config, metrics.registry, [(t.name, t.token_files()) for t in config.tenants])
    spool, owns_spool = _open_spool(config)
    serving = _ServingFlag(endpoint)
    dispatcher: Dispatcher | None = None

    def on_change() -> None:
        serving.update(bool(replicas.routable()))
        if dispatcher is not None:
            dispatcher.wake()

    upstream = upstream_dialer(config.upstream, keepalive)
    replicas = ReplicaSet(config, spool, metrics, on_change, upstream)
    shares = _shares(config, spool)
    dispatcher = Dispatcher(replicas, make_policy(config.policy, routing), routing, metrics, config.fairness, shares)
    proxy_id = config.proxy_id or default_proxy_id(config.host, endpoint.port)
    spool.lineages.origin = proxy_id  # in the stamps of its unloads, which peers merge
    peers = Peers(config, proxy_id, spool, replicas, peer_dialer(config.peering, config.upstream, keepalive))
    fanout = FanOut(spool, replicas, config, metrics, peers)
    await peers.refuse_shared_id()
    core = ProxyCore(ProxyState(config, proxy_id, replicas, metrics, dispatcher, fanout, peers, endpoint.auth))
    servicer = ProxyServicer(core)
    admin = AdminServicer(replicas, config.registration, endpoint.auth, peers.receive_lineages, fanout.proofs.prove_all)
    _add_services(endpoint, servicer, admin)
    await endpoint.start([SERVICE, ADMIN_SERVICE], config.host, config.tls)
    await endpoint.set_health("", True)
    await endpoint.set_health(SERVICE, False)
    for address in config.generators:
        replicas.add(address, "static")
    running = RunningProxy(endpoint, servicer, replicas, spool.folder, owns_spool, peers)
    if config.http.port >= 0:  # FastAPI and uvicorn (~0.4 s): imported only by a proxy that serves the door
        from rollwire.proxy.http.door import Door
        from rollwire.proxy.http.server import HttpServer

        running.http = HttpServer(Door.build(config, core))
        await running.http.start()
    peers.start()
    running.tasks.append(asyncio.create_task(fanout.proofs.run()))
    if config.discover:
        discovery = DnsDiscovery(
            config.discover, config.discover_interval_s, lambda found: replicas.reconcile("dns", found)
        )
        running.tasks.append(asyncio.create_task(discovery.run()))
    sources = {"generators": config.generators, "discover": config.discover, "peers": config.peers}
    log.info(
        "proxy_ready",
        proxy=proxy_id,
        port=endpoint.port,
        metrics_port=endpoint.metrics_port,
        http_port=running.http_port,
        **sources,
    )
    log.info("proxy_settings", policy=config.policy, fanout=config.push.fanout, spool=str(spool.folder))
    return running


def _add_services(endpoint, servicer: ProxyServicer, admin: AdminServicer) -> None:
    """The proxy's GeneratorService and AdminService on its endpoint."""
    generator_pb2_grpc.add_GeneratorServiceServicer_to_server(servicer, endpoint.server)
    admin_pb2_grpc.add_AdminServiceServicer_to_server(admin, endpoint.server)


def _shares(config: ProxyConfig, spool: Spool) -> Shares:
    """The tenants' weights and quotas, which the spool asks of every upload it admits for a
    tenant, counting the tenant's uploads in flight (routing.shares.check_spool_quota)."""
    shares = Shares(config.tenants, config.routing.retry_after_s)
    spool.charge = lambda m: check_spool_quota(shares, spool, config.spool.keep_versions, m)
    return shares


def check_credentials(config: ProxyConfig) -> None:
    """What the proxy holds and sends, checked before it listens: its peering, its own credentials."""
    check_peering(config)
    check_own_credentials(config)


def check_own_credentials(config: ProxyConfig) -> None:
    """No token the proxy sends its replicas (upstream.token_file, upstream.relay_token_file) is
    valid at this proxy, whatever file lists it: each replica holds them, and one replica must
    not be the fleet's admin, a tenant or a peer here (audit 2026-12-07 S2). Raises SystemExit."""
    auth = TokenAuth.from_config(config.auth, [(t.name, t.token_files()) for t in config.tenants])
    if auth is None:
        return
    for setting, path in (
        ("upstream.token_file", config.upstream.token_file),
        ("upstream.relay_token_file", config.upstream.relay_token_file),
    ):
        for token in sorted(read_tokens(path, setting)) if path else ():
            grant = auth.grant([("authorization", f"Bearer {token}")])
            if grant is not None:
                holder = f"tenant {grant.tenant}'s {grant.role}" if grant.tenant else f"the {grant.role}"
                raise SystemExit(
                    f"{setting} holds a token this proxy accepts with {holder} role: every replica holds what the "
                    "proxy dials it with, so a replica could act here with it; give the replicas' roles tokens of "
                    "their own, listed in no file of this proxy (docs/deploy.md, Credentials)"
                )


def check_peering(config: ProxyConfig) -> None:
    """A proxy with peers and auth on must take peer tokens and send one: peers mark their copies
    as a peer's, which only the `peer` role may (security.require_peer), so without them every share
    would be refused and the peers would drift apart. Raises SystemExit with the sentence."""
    auth = config.auth
    missing = [
        k
        for k, v in (
            ("auth.peer_tokens_file", auth.peer_tokens_file),
            ("peering.token_file", config.peering.token_file),
        )
        if not v
    ]
    if config.peers and auth.enabled() and missing:
        raise SystemExit(
            f"peers is set but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not: a peer proxy shares "
            "versions with a `peer` token only (an admin token is refused), so set auth.peer_tokens_file to the tokens "
            "the peers send and peering.token_file to the one this proxy sends (docs/deploy.md, Security)"
        )


def _open_spool(config: ProxyConfig) -> tuple[Spool, bool]:
    """The spool in `spool.dir`, or in a temporary folder the proxy owns (removed at close) when it is empty."""
    s = config.spool
    root = Path(s.dir or tempfile.mkdtemp(prefix="rollwire-spool-"))
    root.mkdir(parents=True, exist_ok=True)
    spool = Spool(
        root,
        max_bytes=s.max_bytes,
        keep_versions=s.keep_versions,
        max_adapter_bytes=s.max_adapter_bytes,
        trust=config.trust.trusted(),
    )
    return spool, not s.dir


def default_proxy_id(host: str, port: int) -> str:
    """proxy@HOST:PORT, where a wildcard bind (0.0.0.0, ::) names the machine instead: every
    pod of a Deployment binds 0.0.0.0 on the same port, and peers that share an id take each
    other for themselves and stop peering (publish/peers.py), so the default must differ per host."""
    import socket

    return f"proxy@{socket.gethostname() if host in ('0.0.0.0', '::', '') else host}:{port}"


class _ServingFlag:
    """Mirrors "some replica is routable" into gRPC health for GeneratorService."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint, self.value = endpoint, False
        self._tasks: set[asyncio.Task] = set()

    def update(self, value: bool) -> None:
        if value != self.value:
            self.value = value
            task = asyncio.get_running_loop().create_task(self.endpoint.set_health(SERVICE, value))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)


async def run_proxy(config: ProxyConfig, ready_file: str | None = None) -> None:
    """Serve until SIGINT/SIGTERM, then stop taking work and let in-flight groups finish."""
    await serve("proxy", await start_proxy(config), config, ready_file)
