"""Publishing an adapter version: relay it down a tree of replicas while it arrives, stage it
everywhere, heal whoever missed it, then commit it everywhere.

One publication (`FanOut.push`; push/README.md walks it, route 1, and heal, route 2):
1. the client's manifest is checked as a replica would (base model, name, version, size,
   spool room); the version's name is locked, so versions of one name are published one at
   a time, in order;
2. cut-through: the bytes go on, `stage_only`, to the proxy's children of a relay tree (or of S
   striped trees, `push.stripes`, one replica under the proxy in each) as they arrive, none
   before the header passed and the completing piece only after the proxy's digests and full
   check (intake.py), so no replica ever holds a complete payload the proxy refused; each
   replica forwards them to its own children while it receives them; the proxy's copy is
   hashed, checked and written to the spool's `.incoming/` alongside, on its reader's worker
   (gRPC chunks) or on the one thread that reads it (the bulk path);
3. the version is committed to the spool (atomically, durably); catch-up leaves it to this
   publication until it ends (`ReplicaSet.publishing`), then uses it for whoever missed it;
4. every replica verifies and stages its own copy; a healthy target that did not stage it
   (its parent died or stalled, or it refused bytes a hop altered) gets it again from the
   proxy's copy: a relay over the missed targets, then directly for any still missing; all
   within `health.push_timeout_s`;
5. the proxy commits (CommitAdapter with the digest) on every target that staged it.

What "all-or-nothing" means: no replica serves the version before every healthy target has
staged it or has definitively failed to (step 4 ended); then it is committed on every
target that staged it, within one round of commit calls. A healthy target that still could
not stage it, or whose commit failed, is taken out of rotation until a catch-up brings it
up to date, so among routable replicas the version is served by all or by none (up to the
commit round). When no target staged it, nothing is committed anywhere, the version leaves
the spool, and the first target's own refusal is returned as the replica gave it.

Further invariants:
- the reply lists every replica: its outcome, or why it was not pushed now;
- a publication, once the upload completed, runs to its end even when the client goes away
  (deadline, cancellation): the version committed to the spool is known good, replicas
  accept it now or on catch-up; an upload cut short stages nothing (every child stream is
  cancelled) and leaves nothing in the spool;
- the proxy holds the payload once in memory, as the chunks it received (`bytes` objects,
  never copied or joined) or as views of the one buffer the bulk path received it into, which
  it forwards and, when healing, sends again; it hashes and checks them once, as they arrive.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from rollwire.common.errors import DeadlineExceeded, FailedPrecondition, Unavailable
from rollwire.common.manifest import manifest_from_pb
from rollwire.common.reasons import Reason
from rollwire.common.writer import MIN_STRIPE_CHUNK
from rollwire.proxy.config import ProxyConfig
from rollwire.proxy.fleet.replica import ReplicaCall
from rollwire.proxy.fleet.replicas import ReplicaSet
from rollwire.proxy.metrics import ProxyMetrics
from rollwire.proxy.publish.header_gate import HeaderGate
from rollwire.proxy.publish.intake import Intake, Piece
from rollwire.proxy.publish.peers import Peers
from rollwire.proxy.publish.proof import ProofBook
from rollwire.proxy.publish.publication import Outcome, Publication, fence_conflicts, publication_reply
from rollwire.proxy.spool import Spool, SpooledAdapter, Upload
from rollwire.proxy.upstream import relay_credentials
from rollwire.push.bulk import BulkDial, BulkListener
from rollwire.push.checks import PayloadInspector
from rollwire.push.forward import Forwarder
from rollwire.push.plan import Child, Target, choose_fanout, grant_children, layout, stripe_chunk_bytes, striped_layout
from rollwire.push.reader import Opening, PushReader, too_slow
from rollwire.push.striped import StripedForwarder
from rollwire.runtime.logs import REQUEST_ID_KEY, get_logger
from rollwire.v1 import generator_pb2 as pb

log = get_logger(__name__)
SUSPECT_S = 600.0
"""A replica whose own relay hop failed is planned as a leaf for this long."""
MIN_HEAL_S = 0.5
"""A heal round starts only with at least this much of the push deadline left."""


class FanOut:
    def __init__(
        self, spool: Spool, replicas: ReplicaSet, config: ProxyConfig, metrics: ProxyMetrics, peers: Peers | None = None
    ) -> None:
        self.spool, self.replicas, self.config, self.metrics = spool, replicas, config, metrics
        self.peers = peers
        self.proofs = ProofBook(spool, replicas, config, metrics)
        """Re-checks each version against its probe after its commit, on demand and on a period (publish/proof.py)."""
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._tasks: set[asyncio.Task] = set()
        self._suspect: dict[str, float] = {}  # address -> when its own relay hop last failed
        self._credentials = relay_credentials(config.upstream)
        self.failed_after_answer: dict[str, str] = {}
        """Per name: why the last publication answered at "spooled" reached no replica (until the next load says so)."""
        self.bulk = BulkListener(config.host, config.bulk, config.tls) if config.bulk.enabled else None
        """The proxy's bulk endpoint for its clients' pushes (rollwire.push.bulk), when enabled."""
        self.bulk_dial = BulkDial.from_config(
            config.bulk, config.upstream, lambda path, reason: metrics.push_paths.labels(path, reason).inc()
        )
        """How it sends replicas their bytes over theirs, for a push whose client asked (None: gRPC chunks only)."""

    def close(self) -> None:
        if self.bulk is not None:
            self.bulk.close()

    # -- receiving (the client's call) ----------------------------------------------------
    async def push(
        self,
        messages: AsyncIterator[pb.PushAdapterRequest],
        request_id: str,
        answer: str = "committed",
        send_metadata: Callable[[tuple], Awaitable[None]] | None = None,
    ) -> pb.PushAdapterResponse:
        """Receive a client's upload, relaying it as it arrives, then publish it. Until the
        upload is complete every exit (a refusal, the client's cancellation) cancels the relay
        and leaves nothing behind; after that the publication runs to its end. `answer`
        "spooled": return once the version is durable in the spool (a reply with no replica
        results) while the relay and commit go on; a failure after that keeps the spool copy
        for catch-up and is counted, logged and told to the next load of the name. `send_metadata`:
        the call's initial metadata (a client's gRPC push: the bulk path's offer)."""
        reader = self._reader(messages)
        upload: Upload | None = None
        lock: asyncio.Lock | None = None
        intake: Intake | None = None
        loop, budget = asyncio.get_running_loop(), asyncio.timeout(None)  # the upload's total deadline, once sized
        try:
            async with budget:
                first = await self._opening(reader)
                fingerprint, base_shapes = self.replicas.push_basis(first.manifest.base_model_fingerprint)
                upload = self.spool.admit(first.manifest, fingerprint, charge=True)  # the tenant's from here
                name_lock = self._locks[first.manifest.name]
                await name_lock.acquire()
                lock = name_lock  # only once held: a caller cancelled while waiting releases nothing
                budget.reschedule(loop.time() + self._upload_s(first.manifest))
                self.spool.check_version(first.manifest)  # again: a publication of this name may have ended meanwhile
                pub = self._start(first.manifest, base_shapes, request_id)
                if send_metadata is not None:  # its hops ask for the bulk path only when its client did
                    pub.bulk = await reader.agree(first, self.bulk, send_metadata)
                m = manifest_from_pb(first.manifest)
                gate, inspector = HeaderGate(m, base_shapes), PayloadInspector(m, base_shapes)
                intake = Intake(reader, gate, inspector, lambda: self._relay(pub, striped=True))
                payload = await intake.take(upload.path)  # digests and tensors checked: the replicas' checks
                upload.validated = True
                took = round(time.monotonic() - pub.started, 4)
                log.info("adapter_upload_received", adapter=m.name, version=m.version, path=reader.path, seconds=took)
        except BaseException as failure:
            exc = self._too_slow(reader) if isinstance(failure, TimeoutError) and budget.expired() else failure
            if intake is not None:
                intake.abort(f"the upload to the proxy failed: {exc}"[:300])
            reader.close()
            if upload is not None:
                upload.discard()
            if lock is not None:
                lock.release()
            if exc is not failure:
                raise exc from None
            raise
        spooled: asyncio.Future[SpooledAdapter] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(self._publish(pub, upload, payload, intake.held, intake.forward, lock, spooled))
        self._tasks.add(task)
        task.add_done_callback(self._finished)
        if answer == "spooled" and await self._spooled_first(pub, task, spooled):
            m = pub.manifest  # its sha256 named by now, when the client left it to the proxy
            return pb.PushAdapterResponse(name=m.name, version=m.version, sha256=m.sha256)
        return await asyncio.shield(task)

    async def _opening(self, reader: PushReader) -> Opening:
        """A client's opening: no transport field of a replica's, its name in its current lineage."""
        first = await reader.open()
        if first.relay.nodes or first.stage_only or first.stripe is not None:
            raise FailedPrecondition(
                "a proxy plans its own relay and stripes, and stages and commits by itself: push without relay, "
                "stage_only and stripe (those are for replicas)",
                reason=Reason.PROXY_PUBLISHES,
            )
        first.manifest.name = self.spool.lineages.internal(first.manifest.name)  # its current lineage
        return first

    def _upload_s(self, manifest: pb.AdapterManifest) -> float:
        return self.config.spool.upload_deadline_s(manifest.byte_length)

    def _too_slow(self, reader: PushReader) -> DeadlineExceeded:
        assert reader.manifest is not None  # the deadline is set once the manifest was read
        self.metrics.client_limited.labels("slow_upload").inc()
        return too_slow(reader.manifest, reader.received, self._upload_s(reader.manifest), "proxy")

    def _reader(self, messages: AsyncIterator[pb.PushAdapterRequest]) -> PushReader:
        """A client's upload, both its digests checked: from here on they name the same bytes (push.digests)."""
        idle = self.config.spool.upload_idle_timeout_s
        return PushReader(messages, idle, "proxy", keep_chunks=True, both_digests=True)

    async def _spooled_first(self, pub: Publication, task: asyncio.Task, spooled: asyncio.Future) -> bool:
        """Whether the version was spooled while the publication still runs (the caller is answered then)."""
        await asyncio.wait({spooled, task}, return_when=asyncio.FIRST_COMPLETED)  # neither is cancelled by ours
        if task.done() or not spooled.done():
            return False
        pub.answered = True  # set before _settle can run: the commit round is still ahead
        key = (pub.manifest.name, pub.manifest.version)
        self.replicas.answered.add(key)
        self.metrics.publications_pending.inc()
        task.add_done_callback(lambda _: self._answered_ended(key))
        return True

    def _start(self, manifest: pb.AdapterManifest, base_shapes, request_id: str) -> Publication:
        targets = self.replicas.healthy()
        if not targets:
            raise Unavailable(
                f"no healthy generator replica to push adapter {manifest.name!r} v{manifest.version} to "
                f"({self.replicas.describe()}); nothing was applied, retry when a replica is up",
                reason=Reason.NO_REPLICA,
                retry_after_s=self.config.routing.retry_after_s,
            )
        deadline = time.monotonic() + self.config.health.push_timeout_s
        pub = Publication(manifest, {r.address: r for r in targets}, deadline, request_id, base_shapes)
        pub.outcomes = {r.address: Outcome(r) for r in targets}
        return pub

    def _finished(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.info("adapter_publish_ended", error=str(task.exception())[:300])

    # -- the relay ------------------------------------------------------------------------
    def _order(self, addresses: list[str]) -> tuple[list[Target], int]:
        """Targets in planning order, the trusted first (inner nodes), then the doubtful (a
        recent failure of their own, or not routable: leaves), and how many are trusted."""
        now = time.monotonic()
        self._suspect = {a: t for a, t in self._suspect.items() if now - t < SUSPECT_S}
        members = {r.address: r for r in self.replicas.all()}

        def doubtful(address: str) -> bool:
            r = members.get(address)
            return address in self._suspect or not (r is not None and r.routable(now))

        order = sorted(addresses, key=lambda a: (doubtful(a), a))
        trusted = sum(not doubtful(a) for a in addresses)
        return [Target(a, members[a].name if a in members else a) for a in order], trusted

    def _relay(
        self, pub: Publication, addresses: list[str] | None = None, star: bool = False, striped: bool = False
    ) -> Forwarder | StripedForwarder:
        """Plan a tree over `addresses` (default: every target) and open the proxy's streams;
        `striped`: deal the push over `push.stripes` trees (when the replicas and the payload's
        chunks are enough for two)."""
        order, trusted = self._order(list(pub.targets) if addresses is None else addresses)
        size = pub.manifest.byte_length
        stripes = min(self.config.push.stripe_count(), trusted, math.ceil(size / MIN_STRIPE_CHUNK)) if striped else 1
        shape: dict[str, int]
        forward: Forwarder | StripedForwarder
        if stripes >= 2:
            chunk = stripe_chunk_bytes(size, stripes)
            # every replica is an inner node of some tree: the doubtful hang under the proxy
            # instead, in every tree, where their failure costs no subtree
            trees = striped_layout(order[:trusted], stripes, leaves=order[trusted:])
            children = [c for tree in trees for c in tree]
            direct = {t.address for t in order[trusted:]}  # only they get every stripe from the proxy
            shape = {"stripes": stripes, "chunk_bytes": chunk}
            forward = StripedForwarder(
                [
                    self._forwarder(pub, tree, pb.Stripe(index=s, count=stripes, chunk_bytes=chunk))
                    for s, tree in enumerate(trees)
                ],
                size,
                chunk,
            )
        else:
            k = len(order) if star else self._fanout(len(order), size)
            children = layout(order, k)
            direct = {c.address for c in children}
            shape = {"fanout": k}
            forward = self._forwarder(pub, children, None)
        for target in order:
            pub.outcomes[target.address].direct = target.address in direct
        log.info(
            "adapter_relay_planned",
            adapter=pub.manifest.name,
            version=pub.manifest.version,
            replicas=len(order),
            **shape,
            children=[c.address for c in children],
        )
        return forward

    def _forwarder(self, pub: Publication, children: list[Child], stripe: pb.Stripe | None) -> Forwarder:
        metadata = ((REQUEST_ID_KEY, pub.request_id), *self._credentials.metadata)
        if (key := self._credentials.grant_key) is not None:  # every node, each granted for this push
            children = grant_children(children, key, pub.manifest)
        return Forwarder(
            children,
            pub.manifest,
            stage_only=True,
            stub_for=lambda address: pub.targets[address].bulk,
            metadata=metadata,
            deadline=pub.deadline,
            queue_chunks=self.config.push.queue_chunks,
            stall_s=self.config.push.stall_timeout_s,
            settle_s=self.config.push.settle_timeout_s,
            stripe=stripe,
            bulk=self.bulk_dial if pub.bulk else None,
        )

    def _fanout(self, n: int, size: int) -> int:
        p = self.config.push
        return choose_fanout(p.fanout, n, size, p.max_fanout)

    async def _collect(self, pub: Publication, forward: Forwarder | StripedForwarder, healing: bool) -> None:
        """Record what the relay tree reported; a replica that failed by itself (not for want of
        a parent) becomes a suspect, planned as a leaf for a while."""
        for r in await forward.results():
            outcome = pub.outcomes.get(r.address)
            if outcome is None:  # a hostile or confused replica reported a stranger: ignore it
                continue
            outcome.code = grpc.StatusCode[r.code] if r.code in grpc.StatusCode.__members__ else grpc.StatusCode.UNKNOWN
            outcome.message, outcome.reason = r.message, r.reason
            if outcome.ok and healing:
                outcome.healed = True
                self.metrics.push_heals.labels(r.address).inc()
            if not outcome.ok and r.reason != Reason.RELAY_NOT_REACHED:
                self._suspect[r.address] = time.monotonic()

    async def _heal(self, pub: Publication, payload: list[Piece]) -> None:
        """Give the bytes again, from the proxy's copy, to every healthy target that missed
        them for a reason another copy may fix: a relay over them, then directly."""
        for star in (False, True):
            healthy = {r.address for r in self.replicas.healthy()}
            missing = [a for a, o in pub.outcomes.items() if o.retry_worthwhile() and a in healthy]
            if not missing or pub.deadline - time.monotonic() < MIN_HEAL_S:
                return
            log.info(
                "adapter_relay_healing",
                adapter=pub.manifest.name,
                version=pub.manifest.version,
                replicas=missing,
                direct=star,
                why={a: f"{pub.outcomes[a].code.name}: {pub.outcomes[a].message[:200]}" for a in missing},
            )
            forward = self._relay(pub, missing, star=star)
            for piece in payload:
                await forward.send(piece)
            forward.end()
            await self._collect(pub, forward, healing=True)

    # -- publishing -----------------------------------------------------------------------
    async def _publish(
        self,
        pub: Publication,
        upload: Upload,
        payload: list[Piece],
        held: Piece | None,
        forward: Forwarder | StripedForwarder | None,
        lock: asyncio.Lock,
        spooled: asyncio.Future[SpooledAdapter],
    ) -> pb.PushAdapterResponse:
        try:
            forward = forward or self._relay(pub, striped=True)
            if held is not None:
                await forward.send_last(held)
            forward.end()
            key = (pub.manifest.name, pub.manifest.version)
            self.replicas.publishing[key] = asyncio.current_task()  # before the spool holds it: catch-up leaves it
            try:
                try:  # the spool write becomes durable while the replicas verify and stage
                    await asyncio.to_thread(self.spool.sync, upload)
                    adapter, created, evicted = await self.spool.commit_async(upload)  # consumes the upload
                    self.replicas.base.adopt(pub.manifest.base_model_fingerprint)
                    spooled.set_result(adapter)  # requests naming it now wait for a replica (ReplicaSet.coming)
                except BaseException as exc:
                    forward.abort(f"the proxy could not spool the payload: {exc}"[:300])
                    upload.discard()
                    raise
                if evicted:  # after the answer at "spooled": a load does not wait for old files to go
                    await asyncio.to_thread(self.spool.delete, evicted)
                await self._collect(pub, forward, healing=False)
                await self._heal(pub, payload)
                del payload
                peers: list[pb.PeerPushResult] = []
                if self.peers is not None and any(o.ok for o in pub.outcomes.values()):
                    # in every peer proxy's spool before any replica serves it
                    peers = await self.peers.share(adapter, pub.request_id)
                    fence_conflicts(self.spool, adapter, created, peers)
                results = await self._commit(pub)
                self.metrics.fanout_latency.observe(time.monotonic() - pub.started)
                return self._settle(pub, adapter, created, results, peers)
            finally:
                self.replicas.publishing.pop(key, None)
        finally:
            lock.release()

    async def _commit(self, pub: Publication) -> list[ReplicaCall]:
        """CommitAdapter on every target that staged the version; the others keep their
        staging failure. One result per target, in address order."""
        timeout = self.config.push.commit_timeout_s
        ready = [o.replica for o in pub.outcomes.values() if o.ok]
        committed = await asyncio.gather(*(r.commit(pub.manifest, timeout, pub.request_id) for r in ready))
        self.replicas.on_change()  # requests waiting for this version may go now
        # in the background: each replica proved a probed version already; an unprobed one is derived and held to it
        self.proofs.after_commit(pub.manifest, [r.replica for r in committed if r.ok])
        by_address = {r.replica.address: r for r in committed}
        results = []
        for address in sorted(pub.outcomes):
            o = pub.outcomes[address]
            result = by_address.get(address) or ReplicaCall(o.replica, o.code, o.message, o.reason)
            self.metrics.pushes.labels(address, result.code.name).inc()
            if result.ok:
                self.metrics.confirmed(address, o.replica.versions, pub.manifest.name)
            results.append(result)
        return results

    def _settle(
        self,
        pub: Publication,
        adapter: SpooledAdapter,
        created: bool,
        results: list[ReplicaCall],
        peers: list[pb.PeerPushResult],
    ) -> pb.PushAdapterResponse:
        accepted = [r for r in results if r.ok]
        log.info(
            "adapter_published",
            adapter=adapter.name,
            version=adapter.version,
            accepted=len(accepted),
            replicas=len(results),
            healed=sum(o.healed for o in pub.outcomes.values()),
            seconds=round(time.monotonic() - pub.started, 4),
        )
        # only a refusal of the proxy's own bytes is the replica's verdict on the version (what
        # quarantine counts); bytes a hop altered, a dead parent or a failed commit are not
        verdicts = [
            r
            for r in results
            if not r.ok and pub.outcomes[r.replica.address].direct and not pub.outcomes[r.replica.address].ok
        ]
        if not accepted:
            if not created or pub.answered:  # a spooled copy stays: maybe one no replica accepts (quarantined then)
                for result in verdicts:
                    self.replicas.catch_up.note_refusal(
                        result.replica, adapter, result.code, result.reason, result.message
                    )
            own = [r for r in results if r.reason not in (Reason.RELAY_NOT_REACHED, Reason.RELAY_ABORTED)]
            if pub.answered:
                self._failed_after_answer(adapter, results, (own or results)[0])
            elif created:
                self.spool.discard(adapter)
            raise (own or results)[0].refusal(self.config.routing.retry_after_s)
        for result in verdicts:
            self.replicas.catch_up.note_refusal(result.replica, adapter, result.code, result.reason, result.message)
        for result in results:
            if not result.ok:
                self.replicas.mark_unsynced(
                    result.replica,
                    f"push of {adapter.name!r} v{adapter.version} failed with {result.code.name}: {result.message}",
                )
        reply = publication_reply(adapter, results, list(pub.targets), self.replicas.all())
        reply.peers.extend(peers)
        return reply

    def _answered_ended(self, key: tuple[str, int]) -> None:
        self.replicas.answered.discard(key)
        self.metrics.publications_pending.dec()

    def _failed_after_answer(self, adapter: SpooledAdapter, results: list[ReplicaCall], first: ReplicaCall) -> None:
        """A publication the caller was told is spooled reached no replica: it stays spooled,
        every target is caught up from the spool (or refuses it, and it is quarantined), and
        the failure is counted, logged and told to the next load of the name."""
        why = f"no replica committed {adapter.name!r} v{adapter.version} ({first.code.name}: {first.message[:200]})"
        self.failed_after_answer[adapter.name] = why
        self.metrics.publications_failed_after_answer.inc()
        log.error("adapter_publish_failed_after_answer", adapter=adapter.name, version=adapter.version, why=why)
        for result in results:
            self.replicas.mark_unsynced(result.replica, why)
