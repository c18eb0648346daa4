"""Publishing an adapter version: spool it, then push it to every healthy replica at once.

Invariants:
- versions of one name are published one at a time, in the order they commit to the spool,
  so every replica receives them in increasing order;
- the reply lists every replica: its push result, or why it was not pushed now;
- the push succeeds when at least one replica accepted it; a healthy replica that refused
  it while others accepted is taken out of rotation until a catch-up brings it up to date;
- when every replica refused, the push itself is at fault: the first replica's status is
  passed through unchanged, the new version leaves the spool and no replica changes state;
- only validated uploads are published (the proxy ran the replicas' checks on them), and a
  publication, once started, runs to its end even when the client goes away (deadline,
  cancellation): the version committed to the spool is known good, replicas accept it now or
  on catch-up, so a cut-off push cannot leave the spool holding something they refuse.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

from rollwire.common.errors import Unavailable
from rollwire.common.logs import get_logger
from rollwire.proxy.config import HealthSection, RoutingSection
from rollwire.proxy.metrics import ProxyMetrics
from rollwire.proxy.relay import Relay
from rollwire.proxy.replica import PushResult, Replica
from rollwire.proxy.replicas import ReplicaSet
from rollwire.proxy.spool import Spool, SpooledAdapter, Upload
from rollwire.v1 import generator_pb2 as pb

log = get_logger(__name__)


class FanOut:
    def __init__(
        self, spool: Spool, replicas: ReplicaSet, health: HealthSection, routing: RoutingSection, metrics: ProxyMetrics
    ) -> None:
        self.spool, self.replicas, self.health, self.routing, self.metrics = spool, replicas, health, routing, metrics
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._tasks: set[asyncio.Task] = set()

    async def publish(self, upload: Upload, request_id: str) -> pb.PushAdapterResponse:
        """Commit a validated `upload` to the spool and push it to every healthy replica
        concurrently. Takes ownership of the upload; a cancelled caller does not stop it."""
        if not upload.validated:
            upload.discard()
            raise RuntimeError("only validated uploads may be published")
        task = asyncio.create_task(self._publish(upload, request_id))
        self._tasks.add(task)
        task.add_done_callback(self._finished)
        return await asyncio.shield(task)

    def _finished(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.info("adapter_publish_ended", error=str(task.exception())[:300])

    async def _publish(self, upload: Upload, request_id: str) -> pb.PushAdapterResponse:
        async with self._locks[upload.manifest.name]:
            adapter, created = self.spool.commit(upload)  # consumes the upload on every exit
            targets = self.replicas.healthy()
            if not targets:
                self._forget(adapter, created)
                raise Unavailable(
                    f"no healthy generator replica to push adapter {adapter.name!r} v{adapter.version} to "
                    f"({self.replicas.describe()}); nothing was applied, retry when a replica is up",
                    reason="NO_REPLICA",
                    retry_after_s=self.routing.retry_after_s,
                )
            start = time.monotonic()
            payload = await adapter.payload()
            results = await asyncio.gather(*(self._push(r, adapter, payload, request_id) for r in targets))
            self.metrics.fanout_latency.observe(time.monotonic() - start)
            accepted = [r for r in results if r.ok]
            log.info(
                "adapter_published",
                adapter=adapter.name,
                version=adapter.version,
                accepted=len(accepted),
                replicas=len(results),
                seconds=round(time.monotonic() - start, 4),
            )
            if not accepted:
                if not created:  # an older spooled copy: maybe one no replica accepts (quarantined then)
                    for result in results:
                        self.replicas.note_refusal(result.replica, adapter, result.code, result.reason, result.message)
                self._forget(adapter, created)
                first = results[0]
                raise (
                    Relay(first.error) if first.error is not None else Unavailable(first.message, reason="PUSH_FAILED")
                )
            for result in results:
                if not result.ok:
                    self.replicas.note_refusal(result.replica, adapter, result.code, result.reason, result.message)
                    self.replicas.mark_unsynced(
                        result.replica,
                        f"push of {adapter.name!r} v{adapter.version} failed with {result.code.name}: {result.message}",
                    )
            return self._reply(adapter, results, targets)

    async def _push(self, replica: Replica, adapter: SpooledAdapter, payload: bytes, request_id: str) -> PushResult:
        async with replica.push_lock:
            result = await replica.push(adapter, payload, self.health.push_timeout_s, request_id)
        self.metrics.pushes.labels(replica.address, result.code.name).inc()
        if result.ok:
            self.metrics.versions.labels(replica.address, adapter.name).set(replica.newest(adapter.name))
        return result

    def _forget(self, adapter: SpooledAdapter, created: bool) -> None:
        if created:
            self.spool.discard(adapter)

    def _reply(
        self, adapter: SpooledAdapter, results: list[PushResult], targets: list[Replica]
    ) -> pb.PushAdapterResponse:
        accepted = [r.reply for r in results if r.ok]
        loaded = set.intersection(*(set(reply.loaded_versions) for reply in accepted))
        per_replica = [r.to_pb() for r in results]
        pushed = {r.address for r in targets}
        per_replica += [
            pb.ReplicaPushResult(
                replica=r.name,
                code="UNAVAILABLE",
                message=f"not pushed now ({r.state()}); it is caught up before it serves again",
            )
            for r in self.replicas.all()
            if r.address not in pushed
        ]
        return pb.PushAdapterResponse(
            name=adapter.name,
            version=adapter.version,
            already_loaded=all(reply.already_loaded for reply in accepted),
            loaded_versions=sorted(loaded),
            replicas=per_replica,
        )
