"""The lineage map between peer proxies: lineages.py's `shared` sent, and merged, over
AdminService.ShareLineages (the `peer` role only: security.PEER_ONLY). peers.py decides
when; this module sends and receives.

Invariants:
- the map travels whole (a few KiB; under 2 MiB at lineages.py's bounds), so any send
  brings a peer up to this proxy's map, and an old send arriving late changes nothing
  (merges keep the larger generation and the later mark);
- after a change made here (an unload, a load that undoes one: awaited by the door) it goes
  to every synced peer at once, each within `peering.timeout_s`, one send per peer at a time
  (the peer's lock, shared with version sends); a peer whose send fails is marked behind,
  never failing the caller, and its catch-up sends the map after the versions;
- a new lineage is told to peers only once the publication of its v1 ended (`later`): that
  publication put the version in their spools first (fanout.py: share before commit), so no
  peer routes NAME to a lineage it cannot serve; after `health.push_timeout_s` + twice
  `peering.timeout_s` it is told all the same (logged);
- received maps are checked by lineages.py before anything changes (BAD_LINEAGES), merged
  durably before the answer, and never sent on: each proxy sends its own to its peers;
- a peer older than ShareLineages (UNIMPLEMENTED) or one that refuses the map for good is
  logged as an error and left synced (its versions still flow); counted per peer and code in
  `rollwire_proxy_peer_lineage_sends_total`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import grpc

from rollwire.common.errors import from_rpc_error
from rollwire.proxy.lineages import Lineages, Mark
from rollwire.proxy.metrics import ProxyMetrics
from rollwire.runtime.logs import REQUEST_ID_KEY, get_logger, new_request_id
from rollwire.v1 import admin_pb2 as apb
from rollwire.v1 import admin_pb2_grpc

log = get_logger(__name__)
REFUSED_FOR_GOOD = frozenset(
    {
        grpc.StatusCode.UNIMPLEMENTED,  # a peer older than ShareLineages
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
    }
)
"""Answers to a map that sending it again would not change (logged as errors)."""


class PeerLink(Protocol):
    """What sending needs of a peer (peers._Peer)."""

    address: str
    channel: grpc.aio.Channel
    synced: bool
    is_self: bool
    lock: asyncio.Lock


class LineageShare:
    def __init__(
        self,
        lineages: Lineages,
        metrics: ProxyMetrics,
        metadata: tuple[tuple[str, str], ...],
        timeout_s: float,
        wait_s: float,
        behind: Callable[[Any, str], None],
    ) -> None:
        """`metadata` carries the peer marker and token; `behind` marks a peer behind."""
        self.lineages, self.metrics, self.metadata, self.behind = lineages, metrics, metadata, behind
        self.timeout_s, self.wait_s = timeout_s, wait_s
        self._later: set[asyncio.Task] = set()

    async def share(self, peers: Iterable[PeerLink]) -> None:
        """The map, as it is when each send starts, to every synced peer at once. Never raises
        for a peer's failure."""
        await asyncio.gather(*(self._share_one(p) for p in list(peers) if p.synced and not p.is_self))

    async def _share_one(self, peer: PeerLink) -> None:
        async with peer.lock:
            if not peer.synced:  # failed meanwhile: its catch-up sends the map
                return
            if not await self.send(peer, self.lineages.shared()):
                self.behind(peer, "sending the lineage map failed")

    def later(self, peers: Callable[[], Iterable[PeerLink]], publication: asyncio.Future | None, name: str, gen: int):
        """Release lineage `gen` of `name` and share the map once `publication` ended, in the
        background (the load answered already)."""

        async def run() -> None:
            if publication is not None:  # its outcome is not ours to raise: failed or not, peers are told
                done, _ = await asyncio.wait({publication}, timeout=self.wait_s)
                if not done:
                    log.warning("lineage_shared_before_publication_ended", adapter=name, generation=gen)
            self.lineages.release(name, gen)
            await self.share(peers())

        task = asyncio.create_task(run())
        self._later.add(task)
        task.add_done_callback(self._later.discard)

    async def send(self, peer: PeerLink, body: tuple[dict[str, int], dict[str, dict[int, Mark]]]) -> bool:
        """The map to one peer; False when sending it again may help (the peer is behind)."""
        generations, marks = body
        request = apb.ShareLineagesRequest(generations=generations, marks=[_marks_pb(n, m) for n, m in marks.items()])
        try:
            reply = await admin_pb2_grpc.AdminServiceStub(peer.channel).ShareLineages(
                request, timeout=self.timeout_s, metadata=(*self.metadata, (REQUEST_ID_KEY, new_request_id()))
            )
            code, message = grpc.StatusCode.OK, f"{reply.changed} changed"
        except grpc.aio.AioRpcError as exc:
            code, message = exc.code(), from_rpc_error(exc).message
        self.metrics.peer_lineage_sends.labels(peer.address, code.name).inc()
        said = log.bind(peer=peer.address, names=len(generations), marked=len(marks))
        if code == grpc.StatusCode.OK:
            said.info("lineages_shared_with_peer", result=message)
        elif code in REFUSED_FOR_GOOD:
            said.error("peer_refused_lineages", code=code.name, error=message)
        else:
            said.warning("peer_lineages_send_failed", code=code.name, error=message)
        return code == grpc.StatusCode.OK or code in REFUSED_FOR_GOOD

    async def receive(self, request: apb.ShareLineagesRequest, origin: str) -> apb.ShareLineagesResponse:
        """Merge a peer's map (checked first, durable before it returns; raises the refusal)."""
        marks: dict[str, dict[int, Mark]] = {}
        for entry in request.marks:
            versions = marks.setdefault(entry.name, {})
            for v in entry.versions:  # a version sent twice: the later mark, as a merge would keep
                mark = Mark(v.at_ns, v.by, v.unloaded)
                versions[v.version] = max(mark, versions.get(v.version, mark))
        changed = self.lineages.merge(dict(request.generations), marks, peer=origin[:256])
        await self.lineages.flush()
        self.metrics.lineage_changes_received.inc(changed)
        return apb.ShareLineagesResponse(changed=changed)

    async def close(self) -> None:
        for task in self._later:
            task.cancel()
        await asyncio.gather(*self._later, return_exceptions=True)


def _marks_pb(name: str, marks: dict[int, Mark]) -> apb.LineageMarks:
    versions = [apb.VersionMark(version=v, unloaded=m.unloaded, at_ns=m.at_ns, by=m.by) for v, m in marks.items()]
    return apb.LineageMarks(name=name, versions=versions)
