"""Catch-up: bringing one replica to the spool's newest versions, and the verdicts it keeps.

Invariants:
- versions are pushed oldest first; the replica is caught up once it holds the newest
  spooled version of every name it is not exempt from; a transient failure ends the round;
- a version a publication (publish/fanout.py) is delivering now is left to that publication;
- a replica refusing a spooled version permanently (INVALID_ARGUMENT, FAILED_PRECONDITION
  other than "already ahead") is not asked for that version again until it reconnects; when
  every healthy replica of the base model has refused a version and none holds it, the
  version is quarantined (spool.py) and catch-up goes on without it, so no stored push can
  keep replicas out of rotation, and nothing is retried forever;
- a refusal that is not for good (UNAVAILABLE, UNKNOWN, TOO_MANY_PUSHES, ...) is retried on
  each round `health.catch_up_attempts` times per (replica, version) at most, then decided
  (`catch_up_gave_up`, `rollwire_proxy_catchup_gave_up_total`): a failure of the replica
  counts as its verdict on the version (quarantine by quorum, as a refusal for good), a busy
  one (RESOURCE_EXHAUSTED) never does; either way the version is not pushed to it again until
  it reconnects or a newer one is published;
- a replica that refused (or was given up on for) versions is routed what it holds: it is
  not behind for them;
- VERSION_CONFLICT (other bytes under that version) is a fault, not "already held": the
  replica stays behind until it holds the spool's newest versions; BASE_MODEL_MISMATCH means
  "wrong replica", never "wrong bytes": the replica is checked again, the version stays.
"""

from __future__ import annotations

from collections.abc import Container
from typing import Protocol

import grpc

from rollwire.common.errors import Unavailable
from rollwire.common.keepalive import RECONNECT_MAX_S
from rollwire.common.reasons import Reason
from rollwire.common.retries import VERSION_TAKEN, push_refused_for_good
from rollwire.proxy.config import ProxyConfig
from rollwire.proxy.fleet.replica import Replica
from rollwire.proxy.metrics import ProxyMetrics
from rollwire.proxy.spool import Spool
from rollwire.runtime.logs import get_logger, new_request_id

log = get_logger(__name__)


class Fleet(Protocol):
    """What catch-up needs of the replica set (replicas.ReplicaSet)."""

    @property
    def publishing(self) -> Container[tuple[str, int]]: ...

    def all(self) -> list[Replica]: ...

    def healthy(self) -> list[Replica]: ...

    def recheck(self, replica: Replica, why: str) -> None: ...

    def note_conflict(self, replica: Replica, name: str, version: int, digest: str) -> None: ...


class CatchUp:
    """The catch-up pushes of a replica set, and the refusals and spent retries it remembers."""

    def __init__(self, config: ProxyConfig, spool: Spool, metrics: ProxyMetrics, fleet: Fleet) -> None:
        self.config, self.spool, self.metrics, self.fleet = config, spool, metrics, fleet
        # (name, version, sha256) -> addresses of replicas that refused it permanently
        self._refusals: dict[tuple[str, int, str], set[str]] = {}
        # (address, name, version, sha256) -> catch-up attempts that failed for now, in a row
        self._tries: dict[tuple[str, str, int, str], int] = {}
        self._gave_up: set[tuple[str, str, int, str]] = set()
        """(address, name, version, sha256) catch-up no longer pushes (bounded retries spent)."""

    def note_refusal(
        self, replica: Replica, adapter, code: grpc.StatusCode, reason: str, message: str, verdict: bool = False
    ) -> bool:
        """Record a replica's refusal of a spooled version; quarantine the version when every
        healthy replica of the base model refused it for good (or `verdict`: catch-up's retries
        were spent on it) and none holds it. True when the version is (now) out of the spool."""
        if not self.spool.holds(adapter):
            return True
        if reason == Reason.BASE_MODEL_MISMATCH:  # the replica is wrong, not the bytes: look at it again
            self.fleet.recheck(
                replica, f"it refused {adapter.name!r} v{adapter.version} as trained on another base model"
            )
            return False
        if not (verdict or push_refused_for_good(code, reason)) or replica.foreign:
            return False
        key = (adapter.name, adapter.version, adapter.manifest.sha256)
        live = {(a.name, a.version, a.manifest.sha256) for n in self.spool.names() for a in self.spool.versions(n)}
        for stale in [k for k in self._refusals if k not in live]:
            del self._refusals[stale]
        refusers = self._refusals.setdefault(key, set())
        refusers.add(replica.address)
        peers = self.fleet.healthy()
        if any(r.holds(adapter.name, adapter.version) for r in self.fleet.all()):
            return False
        if not peers or not {r.address for r in peers} <= refusers:
            return False
        why = (
            f"every replica ({', '.join(sorted(refusers))}) refused {adapter.name!r} v{adapter.version}; "
            f"the last with {code.name} {reason}: {message}"
        )
        if self.spool.quarantine(adapter, why):
            self.metrics.quarantined.inc()
            log.error("adapter_quarantined", adapter=adapter.name, version=adapter.version, why=why)
        del self._refusals[key]
        for r in peers:
            if not r.synced:
                r.wake.set()  # catch up now, without the quarantined version
        return True

    def _refused_by(self, replica: Replica, adapter) -> bool:
        return replica.address in self._refusals.get((adapter.name, adapter.version, adapter.manifest.sha256), ())

    def forget(self, address: str) -> None:
        """Forget a replica's refusals and spent retries (it reconnected or left)."""
        for refusers in self._refusals.values():
            refusers.discard(address)
        self._gave_up = {k for k in self._gave_up if k[0] != address}
        self._tries = {k: n for k, n in self._tries.items() if k[0] != address}

    def _skips(self, replica: Replica, adapter) -> bool:
        """Catch-up does not push this version to this replica (it refused it, or its retries
        were spent on it) until the replica reconnects."""
        key = (replica.address, adapter.name, adapter.version, adapter.manifest.sha256)
        return self._refused_by(replica, adapter) or key in self._gave_up

    def _retry_spent(self, replica: Replica, adapter, result) -> bool:
        """A catch-up push failed for now; True once `health.catch_up_attempts` of them in a row
        were spent on this (replica, version): then it is decided, loudly."""
        key = (replica.address, adapter.name, adapter.version, adapter.manifest.sha256)
        tries = self._tries[key] = self._tries.get(key, 0) + 1
        if tries < self.config.health.catch_up_attempts:
            return False
        del self._tries[key]
        self._gave_up.add(key)
        self.metrics.catchup_gave_up.labels(replica.address).inc()
        busy = result.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        log.warning(
            "catch_up_gave_up",
            replica=replica.address,
            adapter=adapter.name,
            version=adapter.version,
            attempts=tries,
            code=result.code.name,
            error=result.message,
            decision="it is routed what it holds" + ("" if busy else "; its failure counts towards quarantine"),
        )
        if not busy:  # a busy replica says nothing about the bytes
            self.note_refusal(replica, adapter, result.code, result.reason, result.message, verdict=True)
        return True

    async def run(self, replica: Replica) -> bool:
        """Push every spooled version above what the replica holds, oldest first. A version
        that ends up quarantined is skipped; one this replica refused for good is not pushed
        again (until it reconnects) and is skipped; the replica is caught up once it holds the
        newest spooled version of every name. A transient failure ends the round."""
        for name in self.spool.names():
            for adapter in self.spool.versions(name):
                if not self._due(replica, adapter):
                    continue
                try:
                    payload = await adapter.payload()
                except Unavailable:
                    continue  # quarantined or evicted meanwhile
                if not await self._push(replica, adapter, payload):
                    return False
        return self._caught_up(replica)

    def _due(self, replica: Replica, adapter) -> bool:
        """The replica lacks this spooled version, and catch-up is the one to bring it."""
        if adapter.version <= replica.newest(adapter.name) or not self.spool.holds(adapter):
            return False
        if (adapter.name, adapter.version) in self.fleet.publishing:
            return False
        # it would refuse again: pushing the bytes again would change nothing
        return not (self._skips(replica, adapter) or (adapter.name, adapter.version) in replica.conflicts)

    async def _push(self, replica: Replica, adapter, payload) -> bool:
        """Push one version; False when the round ends here (a transient failure, or the
        replica turned out to be the wrong one)."""
        name = adapter.name
        keepalive = self.config.keepalive.keepalive()  # a connect attempt's timeout, then the next one's wait
        connect_within = keepalive.timeout_s + RECONNECT_MAX_S
        result = await replica.push(
            adapter, payload, self.config.health.push_timeout_s, new_request_id(), connect_within
        )
        self.metrics.pushes.labels(replica.address, result.code.name).inc()
        if result.ok:
            self._tries.pop((replica.address, name, adapter.version, adapter.manifest.sha256), None)
            self.metrics.catchup_pushes.labels(replica.address).inc()
            log.info("replica_caught_up", replica=replica.address, adapter=name, version=adapter.version)
        elif result.reason == Reason.VERSION_CONFLICT:  # other bytes under this version: a fault
            self.fleet.note_conflict(replica, name, adapter.version, "")
        elif result.reason == Reason.BASE_MODEL_MISMATCH:  # the replica is wrong, not the bytes
            self.fleet.recheck(replica, f"it refused {name!r} v{adapter.version} as trained on another base model")
            return False
        elif result.reason not in VERSION_TAKEN:  # else it already holds that version or a newer one
            log.warning(
                "catch_up_failed",
                replica=replica.address,
                adapter=name,
                version=adapter.version,
                code=result.code.name,
                error=result.message,
            )
            replica.detail = f"catching up {name} v{adapter.version} failed with {result.code.name}: {result.message}"
            if not push_refused_for_good(result.code, result.reason):
                if self._retry_spent(replica, adapter, result):
                    return True
                replica.synced = False
                return False
            self.note_refusal(replica, adapter, result.code, result.reason, result.message)
        return True

    def _caught_up(self, replica: Replica) -> bool:
        """Whether the replica holds the newest spooled version of every name (those it refused
        or was given up on for excepted); says in its status what it lacks or is behind on."""
        wanted = {
            n: [v for v in self.spool.versions(n) if (n, v.version) not in self.fleet.publishing]
            for n in self.spool.names()
        }
        lacking = [f"{n} v{v.version}" for n, vs in wanted.items() for v in vs if self._skips(replica, v)]
        replica.lacking = (
            f"routed what it holds; it lacks {', '.join(lacking)} (refused or given up)" if lacking else ""
        )
        behind = [
            f"{n} v{vs[-1].version}"
            for n, all_versions in wanted.items()
            if (vs := [v for v in all_versions if not self._skips(replica, v)]) and replica.newest(n) < vs[-1].version
        ]
        if behind:
            replica.synced = False
            replica.detail = f"it does not hold {', '.join(behind)}"
            if replica.conflicts:
                held = ", ".join(f"{n} v{v}" for n, v in sorted(replica.conflicts))
                replica.detail += (
                    f"; it holds {held} with other bytes than the spool's (one digest per version): restart it with "
                    "an empty adapter window, or remove it"
                )
            return False
        return True
