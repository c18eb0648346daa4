"""Several proxies, one truth about adapter versions: every version one proxy publishes is in
every other proxy's spool before its push returns OK, so any proxy can catch a replica up.

Sending (`Peers.share`, called once by fanout.py, after the replicas staged the version and
before they commit it): the spooled version goes to every peer proxy at once, as a PushAdapter
carrying `PEER_KEY` metadata (this proxy's id), within `peering.timeout_s`.

Receiving (`Peers.receive`, for a push carrying `PEER_KEY`): the version is checked like any
push (manifest, digest, tensors; a version already held with that digest is answered after
the manifest, without the payload) and committed to the spool (atomically, durably); it is
never fanned out to the replicas (the sender does that) and never sent on to other peers, so
there are no loops and no double fan-out. Then requests for "latest" of that name wait (to
their own deadline) until this proxy sees a routable replica serve the version (it re-reads
the replicas every `REFRESH_EVERY_S` meanwhile), so a client that moves from one proxy to the
other never sees its versions go backwards: the sender commits it on the replicas right after,
and if none serves it within `peering.hold_s` (the sender died before committing) this proxy
catches them up to it from its own spool. Only a version no longer spooled is let go.

Invariants:
- a peer that is down, partitioned or slow never fails a push: its send fails within
  `peering.timeout_s` (sooner: the connection's keepalive bound), it is marked behind
  (`rollwire_proxy_peer_synced` 0) and skipped by later pushes until it is caught up;
- a monitor per peer checks it every `peering.interval_s` (gRPC health, `health.timeout_s`);
  a peer that fails the check, or whose connection drops (it restarted, perhaps with an empty
  spool), is marked behind; one found answering again is sent every spooled version, oldest
  first (those it holds cost a manifest each), and is synced once a whole pass sent nothing
  new, with no await between that check and the flag, so no version published meanwhile is
  missed (`share` runs after the spool commit and sends to every synced peer);
- what was built instead of "a proxy pulls at start what its peers hold": the peers push. A
  proxy that starts (or comes back) is a new or dropped connection to each of its peers, so
  every peer sends it all its spool within one check interval; there is no pull RPC;
- a peer whose GetStatus reports this proxy's own id and instance is this proxy (a `dns:///`
  entry that resolves to every proxy, itself included): never sent to. Proxy ids must be
  unique: a start whose static peer answers with this id is refused (`refuse_shared_id`);
- a peer's push carries the marker and the `peer` role (`peering.token_file` here, in the
  receiver's `auth.peer_tokens_file`); the marker is honoured from that role only, and that
  role publishes nothing (security.py), so no caller can put a version in one proxy's spool
  without the fleet's replicas and peers;
- a peer holding another digest under a version is two truths: the push is fenced (not
  committed, its spool copy quarantined) and fails PEER_VERSION_CONFLICT, counted in
  `rollwire_proxy_peer_version_conflicts_total`; the push reply lists every peer's outcome
  (`PushAdapterResponse.peers`), so a peer that is behind is named, not hidden behind OK.

The lineage map and unloads (lineages.py) travel to peers too (lineage_share.py): after each
change made here, and whole after the versions in every catch-up (the map read before the
spool, so a lineage it names has its first version in that pass); a peer is synced only if
neither changed meanwhile, so one that was down or restarted holds the same map once synced.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rollwire.common import writer
from rollwire.common.errors import FailedPrecondition, Unavailable, from_rpc_error
from rollwire.common.reasons import Reason
from rollwire.common.retries import VERSION_TAKEN, push_refused_for_good
from rollwire.proxy.publish.lineage_share import LineageShare
from rollwire.push.buffers import as_bytes
from rollwire.push.reader import PushReader
from rollwire.runtime.config import ConfigError
from rollwire.runtime.logs import REQUEST_ID_KEY, get_logger, new_request_id
from rollwire.runtime.waits import wait_at_most
from rollwire.serving.dial import on_each_drop
from rollwire.v1 import admin_pb2 as apb
from rollwire.v1 import generator_pb2 as pb
from rollwire.v1 import generator_pb2_grpc

if TYPE_CHECKING:
    from rollwire.proxy.config import ProxyConfig
    from rollwire.proxy.fleet.replicas import ReplicaSet
    from rollwire.proxy.spool import Spool, SpooledAdapter
    from rollwire.serving.dial import Dialer

log = get_logger(__name__)
PEER_KEY = "x-rollwire-peer"
"""Metadata of a push from a peer proxy; its value is the sender's proxy id."""
REFRESH_EVERY_S = 0.05
"""While a received version is held, how often the replicas are asked what they serve."""


@dataclass(eq=False)
class _Peer:
    address: str
    channel: grpc.aio.Channel
    stub: generator_pb2_grpc.GeneratorServiceStub
    health: health_pb2_grpc.HealthStub
    bulk_channel: grpc.aio.Channel
    """Pushes to the peer, on a connection of their own (Dialer.channel)."""
    synced: bool = False
    """Known to hold every version this proxy spools: pushes are sent to it."""
    is_self: bool = False
    dropped: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Sends to one peer go one at a time, in order."""
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: list[asyncio.Task] = field(default_factory=list)


class Peers:
    """This proxy's peer proxies: sending published versions, receiving theirs."""

    def __init__(self, config: ProxyConfig, proxy_id: str, spool: Spool, replicas: ReplicaSet, dialer: Dialer) -> None:
        """Peers are `config.peers`, dialled with `dialer` (the peering section over upstream's);
        a peer's health check has the replicas' deadline, and a push it sends the same idle
        deadline as any other."""
        self.entries, self.section = list(config.peers), config.peering
        self.spool, self.replicas, self.metrics, self.proxy_id = spool, replicas, replicas.metrics, proxy_id
        self.dialer = dialer
        self.metadata = self.dialer.metadata
        self.check_timeout_s, self.idle_s = config.health.timeout_s, config.spool.upload_idle_timeout_s
        self.peers: dict[str, _Peer] = {}
        self._from_dns: dict[str, set[str]] = {}
        self._tasks: list[asyncio.Task] = []
        self._holds: dict[str, tuple[int, float]] = {}  # name -> (version a peer sent, hold until)
        self._refresher: asyncio.Task | None = None
        marker = ((PEER_KEY, proxy_id), *self.metadata)
        wait_s = config.health.push_timeout_s + 2 * self.section.timeout_s  # a publication's longest, roughly
        self.lineages = LineageShare(spool.lineages, self.metrics, marker, self.section.timeout_s, wait_s, self._behind)
        self.instance = secrets.token_hex(8)
        """This process's draw (GetStatus.instance): one id with another instance is another proxy."""

    # -- membership -----------------------------------------------------------------------
    async def refuse_shared_id(self) -> None:
        """Refuse to start when a static peer that answers already goes by this proxy's id: peers
        that share an id cannot tell each other's copies apart in logs and metrics, and a proxy
        older than `GetStatus.instance` would take the other for itself and stop peering."""
        for address in (e for e in self.entries if not e.startswith("dns:")):
            channel = self.dialer.channel(address)
            try:
                stub = generator_pb2_grpc.GeneratorServiceStub(channel)
                status = await stub.GetStatus(
                    pb.GetStatusRequest(), timeout=self.check_timeout_s, metadata=self.metadata
                )
            except grpc.aio.AioRpcError:
                continue  # down or not yet up: its own start checks against this one
            finally:
                await channel.close(grace=None)
            if status.replica == self.proxy_id and status.instance != self.instance:
                raise ConfigError(
                    f"peer proxy {address} already goes by this proxy's id {self.proxy_id!r}: give each proxy "
                    "a unique --proxy-id (proxy_id) when peers are configured"
                )

    def start(self) -> None:
        """Open a link to every static peer, resolve the dns:/// ones; monitors start now."""
        from rollwire.proxy.fleet.discovery import DnsDiscovery

        for entry in self.entries:
            if entry.startswith("dns:"):
                found = DnsDiscovery(entry, self.section.interval_s * 10, lambda a, e=entry: self._resolved(e, a))
                self._tasks.append(asyncio.create_task(found.run()))
            else:
                self._add(entry)

    def _resolved(self, entry: str, addresses: set[str]) -> None:
        """A dns:/// entry's addresses now: new ones get a link, vanished ones lose theirs."""
        before, self._from_dns[entry] = self._from_dns.get(entry, set()), addresses
        for address in sorted(addresses - before):
            self._add(address)
        static = {e for e in self.entries if not e.startswith("dns:")}
        still = static.union(*self._from_dns.values())
        for address in sorted(before - addresses - still):
            peer = self.peers.pop(address, None)
            if peer is not None:
                self._drop(peer)

    def _add(self, address: str) -> None:
        if address in self.peers:
            return
        channel, bulk = self.dialer.channel(address), self.dialer.channel(address, bulk=True)
        stub, health = generator_pb2_grpc.GeneratorServiceStub(channel), health_pb2_grpc.HealthStub(channel)
        peer = _Peer(address, channel, stub, health, bulk)
        self.peers[address] = peer
        self.metrics.know_peer(address)
        peer.tasks = [
            asyncio.create_task(self._monitor(peer)),
            asyncio.create_task(on_each_drop(channel, lambda: self._behind(peer, "its connection dropped"))),
        ]
        log.info("peer_added", peer=address)

    def _drop(self, peer: _Peer) -> None:
        """Stop a peer's tasks, close its link and forget its series (it left, or is this proxy)."""
        current = asyncio.current_task()
        for task in peer.tasks:
            if task is not current:
                task.cancel()
        peer.dropped = True
        self._tasks += [asyncio.create_task(c.close(grace=None)) for c in (peer.channel, peer.bulk_channel)]
        for metric in (self.metrics.peer_pushes, self.metrics.peer_synced, self.metrics.peer_lineage_sends):
            for labels in list(metric._metrics):  # prometheus_client keeps children by label tuple
                if labels and labels[0] == peer.address:
                    metric.remove(*labels)
        if not peer.is_self:
            log.info("peer_removed", peer=peer.address)

    async def close(self) -> None:
        await self.lineages.close()
        tasks = [*self._tasks, *(t for p in self.peers.values() for t in p.tasks)]
        if self._refresher is not None:
            tasks.append(self._refresher)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for peer in self.peers.values():
            if not peer.dropped:
                await peer.channel.close(grace=None)
                await peer.bulk_channel.close(grace=None)

    # -- sending --------------------------------------------------------------------------
    async def share(self, adapter: SpooledAdapter, request_id: str = "") -> list[pb.PeerPushResult]:
        """Store `adapter` (just committed to this proxy's spool) in every synced peer's spool,
        at once, each within `peering.timeout_s`; a peer that fails is marked behind. Returns
        when every send ended, one result per peer (by address; this proxy excluded): OK when
        its spool holds the version, PEER_BEHIND for one being caught up (not sent now), else
        the send's failure (PEER_VERSION_CONFLICT: it holds other bytes under this version).
        Never raises for a peer's failure."""
        peers = sorted((p for p in self.peers.values() if not p.is_self), key=lambda p: p.address)
        if not any(p.synced for p in peers):
            return [_behind(p.address) for p in peers]
        try:
            payload = await adapter.payload()
        except Unavailable:
            return []  # evicted or quarantined meanwhile: nothing to share
        request_id = request_id or new_request_id()
        started = time.monotonic()
        results = await asyncio.gather(*(self._share_one(p, adapter, payload, request_id) for p in peers))
        seconds = round(time.monotonic() - started, 4)
        said = log.bind(adapter=adapter.name, version=adapter.version)
        said.info(
            "adapter_shared_with_peers",
            peers=len(peers),
            delivered=sum(r.code == "OK" for r in results),
            seconds=seconds,
        )
        return results

    async def _share_one(
        self, peer: _Peer, adapter: SpooledAdapter, payload: bytes, request_id: str
    ) -> pb.PeerPushResult:
        if not peer.synced:  # its catch-up will send this version
            return _behind(peer.address)
        async with peer.lock:
            if not peer.synced:  # it failed meanwhile
                return _behind(peer.address)
            result = await self._send(peer, adapter, payload, request_id)
            if not _delivered(result):
                self._behind(peer, f"sending {adapter.name!r} v{adapter.version} failed")
            return result

    async def _send(self, peer: _Peer, adapter: SpooledAdapter, payload: bytes, request_id: str) -> pb.PeerPushResult:
        """One version to one peer. A VERSION_CONFLICT (the peer holds other bytes under this
        version) is two truths: counted, logged as an error and answered PEER_VERSION_CONFLICT,
        never taken for delivery of these bytes."""
        metadata = ((PEER_KEY, self.proxy_id), (REQUEST_ID_KEY, request_id), *self.metadata)
        try:
            await generator_pb2_grpc.GeneratorServiceStub(peer.bulk_channel).PushAdapter(
                writer.messages(adapter.manifest, payload), timeout=self.section.timeout_s, metadata=metadata
            )
            code, reason, message = grpc.StatusCode.OK, "", ""
        except grpc.aio.AioRpcError as exc:
            err = from_rpc_error(exc)
            code, reason, message = exc.code(), err.reason, err.message
        self.metrics.peer_pushes.labels(peer.address, code.name).inc()
        said = log.bind(peer=peer.address, adapter=adapter.name, version=adapter.version)
        if reason == Reason.VERSION_CONFLICT:
            self.metrics.peer_conflicts.labels(peer.address).inc()
            said.error("peer_version_conflict", sha256=adapter.manifest.sha256, error=message)
            reason = Reason.PEER_VERSION_CONFLICT
            message = (
                f"peer proxy {peer.address} holds {adapter.name!r} v{adapter.version} with another digest than "
                f"sha256 {adapter.manifest.sha256[:12]}...: two pushes gave this version different bytes"
            )
        elif code != grpc.StatusCode.OK and reason not in VERSION_TAKEN:
            if push_refused_for_good(code, reason):
                said.error("peer_refused_version", code=code.name, error=message)
            else:
                said.warning("peer_send_failed", code=code.name, error=message)
        return pb.PeerPushResult(address=peer.address, code=code.name, message=message, reason=reason)

    # -- the lineage map (lineage_share.py) ------------------------------------------------
    async def share_lineages(self) -> None:
        """Send the lineage map to every synced peer at once (the door awaits it after a change)."""
        await self.lineages.share(self.peers.values())

    def share_lineage_after(self, publication: asyncio.Future | None, name: str, generation: int) -> None:
        """Tell peers `name` means lineage `generation` once `publication` (of its v1) ended."""
        self.lineages.later(lambda: self.peers.values(), publication, name, generation)

    async def receive_lineages(self, request: apb.ShareLineagesRequest, metadata) -> apb.ShareLineagesResponse:
        """Merge a peer's lineage map; never sent on to other peers (each sends its own)."""
        return await self.lineages.receive(request, self.origin(metadata))

    def _behind(self, peer: _Peer, why: str) -> None:
        if peer.synced:
            log.warning("peer_behind", peer=peer.address, why=why)
        peer.synced = False
        self.metrics.peer_synced.labels(peer.address).set(0)
        peer.wake.set()

    # -- keeping peers in step --------------------------------------------------------------
    async def _monitor(self, peer: _Peer) -> None:
        while True:
            peer.wake.clear()
            if await self._answers(peer):
                if not peer.synced:
                    await self._catch_up(peer)
            elif peer.is_self:  # kept in `peers` (a DNS refresh must not add it again), without a link
                self._drop(peer)
                return
            else:
                self._behind(peer, "it does not answer health checks")
                peer.wake.clear()  # _behind wakes the monitor; this is the monitor: wait the interval, do not spin
            await wait_at_most(peer.wake.wait(), self.section.interval_s)

    async def _answers(self, peer: _Peer) -> bool:
        """A health check; before a catch-up, also who it is (GetStatus), to skip this proxy."""
        timeout = self.check_timeout_s
        try:
            await peer.health.Check(health_pb2.HealthCheckRequest(), timeout=timeout, metadata=self.metadata)  # pyright: ignore[reportAttributeAccessIssue]  # grpc's stubs lack it; it exists at run time
            if not peer.synced:
                status = await peer.stub.GetStatus(pb.GetStatusRequest(), timeout=timeout, metadata=self.metadata)
                if status.replica == self.proxy_id and status.instance in ("", self.instance):
                    peer.is_self = True
                    log.info("peer_is_this_proxy", peer=peer.address)
                    return False
                if status.replica == self.proxy_id:
                    log.error("peer_shares_proxy_id", peer=peer.address, proxy_id=self.proxy_id)
        except grpc.aio.AioRpcError:
            return False
        return True

    def _spooled(self) -> list[SpooledAdapter]:
        return [a for name in self.spool.names() for a in self.spool.versions(name)]

    async def _catch_up(self, peer: _Peer) -> None:
        """Send the peer every spooled version, oldest first per name, then the lineage map
        (read before the spool: a lineage it names has its first version in this pass), until
        a pass sends nothing new and the map did not change; then it is synced (the check and
        the flag with no await between)."""
        lineages = self.spool.lineages
        async with peer.lock:
            while not peer.synced:
                revision, names = lineages.revision, lineages.shared()
                spooled = self._spooled()
                for adapter in spooled:
                    if not self.spool.holds(adapter):
                        continue
                    try:
                        payload = await adapter.payload()
                    except Unavailable:
                        continue
                    if not _delivered(await self._send(peer, adapter, payload, new_request_id())):
                        return  # still behind: the monitor tries again
                if not await self.lineages.send(peer, names):
                    return
                if self._spooled() == spooled and lineages.revision == revision:
                    peer.synced = True
                    self.metrics.peer_synced.labels(peer.address).set(1)
                    log.info("peer_synced", peer=peer.address, versions=len(spooled))

    # -- receiving ----------------------------------------------------------------------
    @staticmethod
    def origin(metadata) -> str:
        """The sending proxy's id when a push comes from a peer proxy, else ""."""
        return next((str(v) for k, v in metadata or () if k == PEER_KEY), "")

    async def receive(
        self, messages: AsyncIterator[pb.PushAdapterRequest], origin: str, request_id: str
    ) -> pb.PushAdapterResponse:
        """Check and spool a version a peer proxy sent; no fan-out, no further sharing."""
        reader = PushReader(messages, self.idle_s, "proxy")
        upload = None
        try:
            first = await reader.open()
            if first.relay.nodes or first.stage_only:
                raise FailedPrecondition(
                    "a peer proxy sends whole versions for the spool: push without relay and stage_only",
                    reason=Reason.PROXY_PUBLISHES,
                )
            m = first.manifest
            if self.spool.check_version(m):  # held with this digest: the payload need not travel
                self._hold(m.name, m.version)
                held = self.spool.get(m.name, m.version)
                assert held is not None  # check_version says it is spooled
                sha256 = held.manifest.sha256  # the manifest's may be left to this proxy
                return pb.PushAdapterResponse(name=m.name, version=m.version, already_loaded=True, sha256=sha256)
            upload = self.spool.admit(m, self.replicas.fingerprint or None)
            async for _ in reader.chunks(store=upload.path):
                pass
            payload = as_bytes(await reader.finish())  # bytes already: a peer sends gRPC chunks
            await self.spool.validate(upload, payload, self.replicas.base_shapes)
            staged, upload = upload, None
            adapter, created = self.spool.commit(staged)  # consumes the upload on every exit
            self.replicas.base.adopt(m.base_model_fingerprint)
        finally:
            reader.close()
            if upload is not None:
                upload.discard()
        self._hold(m.name, m.version)
        log.info("adapter_received_from_peer", peer=origin, adapter=m.name, version=m.version, created=created)
        for replica in self.replicas.all():
            if not replica.synced:
                replica.wake.set()  # a replica catching up may use it now
        return pb.PushAdapterResponse(
            name=adapter.name, version=adapter.version, already_loaded=not created, sha256=adapter.manifest.sha256
        )

    # -- "latest" never goes backwards across proxies ---------------------------------------
    def _hold(self, name: str, version: int) -> None:
        if self.replicas.latest(name) >= version:
            return
        held, _ = self._holds.get(name, (0, 0.0))
        self._holds[name] = (max(held, version), time.monotonic() + self.section.hold_s)
        if self._refresher is None or self._refresher.done():
            self._refresher = asyncio.create_task(self._refresh())

    def _unheld(self, name: str) -> bool:
        """True once no version of `name` a peer sent waits to be served here. A held version is
        let go only when a routable replica serves it, or when it can never be served (no
        longer spooled: quarantined or evicted); never because time passed, so a client that
        saw it through the sender never gets an older one here."""
        hold = self._holds.get(name)
        if hold is None:
            return True
        version, until = hold
        if self.replicas.latest(name) >= version or self.spool.get(name, version) is None:
            self._holds.pop(name, None)
            return True
        if until and time.monotonic() >= until:  # the sender has not committed it: catch up from here
            log.warning("peer_version_not_served", adapter=name, version=version, hold_s=self.section.hold_s)
            self._holds[name] = (version, 0.0)
            self.replicas.check_now()
        return False

    async def settled(self, name: str, timeout_s: float) -> None:
        """Return once no version of `name` a peer sent is still waiting to be served here,
        or after `timeout_s` (the request's own deadline) at most."""
        end = time.monotonic() + timeout_s
        while not self._unheld(name) and time.monotonic() < end:
            await asyncio.sleep(REFRESH_EVERY_S)

    async def _refresh(self) -> None:
        """While some version is held, re-read what every healthy replica serves."""
        while not all([self._unheld(name) for name in list(self._holds)]):
            await asyncio.gather(*(self.replicas.refresh(r) for r in self.replicas.healthy()))
            await asyncio.sleep(REFRESH_EVERY_S)


def _behind(address: str) -> pb.PeerPushResult:
    return pb.PeerPushResult(
        address=address,
        code=grpc.StatusCode.UNAVAILABLE.name,
        message="not sent now: this peer is behind and is sent every version it lacks once it answers",
        reason=Reason.PEER_BEHIND,
    )


def _delivered(result: pb.PeerPushResult) -> bool:
    """Nothing is gained by sending these bytes to that peer again: it holds them (or a newer
    version), holds other ones (a conflict, alerted), or refuses them for good."""
    if result.code == grpc.StatusCode.OK.name or result.reason in (*VERSION_TAKEN, Reason.PEER_VERSION_CONFLICT):
        return True
    return push_refused_for_good(grpc.StatusCode[result.code], result.reason)


__all__ = ["PEER_KEY", "Peers"]
