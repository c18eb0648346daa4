"""Tenants' shares of the fleet: weighted fair queueing between tenants, and their quotas of
work (proxy/tenants.py; the dispatcher, dispatch.py, asks these).

Weighted fair share, as start-time fair queueing over tenants: each tenant keeps a virtual
time that grows by `work / weight` with every slot it is granted (work = n x max_new_tokens,
the tokens a group may generate); a free slot goes to the waiting tenant with the least
virtual time (then, inside it, to its client served longest ago). The fleet's virtual time
is where the last grant started (it never goes back); a tenant that starts waiting moves up
to it if its own is behind, so time it spent idle (or with nothing queued) is no credit it
can spend later, and a tenant granted the queue's tail while the others had nothing queued
is not held back for it when they return.

Invariants:
- work-conserving: a free slot goes to some waiter whenever one can use it, so a tenant alone
  may use the whole fleet;
- under contention, tenants that keep waiting are granted work in proportion to their
  weights (within one request's work of it), whatever their number of clients or requests;
- a quota is checked before any work, and a request over one is refused with
  RESOURCE_EXHAUSTED, reason TENANT_QUOTA, a retry hint and a sentence naming the quota;
- every tenant's counters return to zero when its requests end (the dispatcher releases what
  it took exactly once).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rollwire.common.errors import ResourceExhausted
from rollwire.common.manifest import TENANT_SEPARATOR
from rollwire.common.reasons import Reason
from rollwire.proxy.tenants import FLEET, QuotaSection, TenantSection

if TYPE_CHECKING:
    from rollwire.proxy.spool import Spool
    from rollwire.v1 import generator_pb2 as pb


@dataclass(eq=False)
class Share:
    """One tenant's share: its weight, quotas, virtual time and what it holds now."""

    name: str
    weight: float = 1.0
    quotas: QuotaSection = field(default_factory=QuotaSection)
    vtime: float = 0.0
    """Work granted so far, divided by the weight, from where it last started waiting."""
    in_flight: int = 0
    """Requests open (queued or running), every client of the tenant together."""
    queued_work: int = 0
    waiting: int = 0
    bucket: float = -1.0
    """Tokens it may still admit now (the tokens/s quota; -1 = full, set on first use)."""
    bucket_at: float = 0.0


class Shares:
    """Every tenant's share (the config's, and FLEET's for the fleet's own tokens, weight 1)."""

    def __init__(
        self,
        tenants: Iterable[TenantSection] = (),
        retry_after_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.retry_after_s, self.clock = retry_after_s, clock
        self.shares = {t.name: Share(t.name, t.weight, t.quotas) for t in tenants}
        self.shares.setdefault(FLEET, Share(FLEET))
        self.vnow = 0.0
        """The fleet's virtual time: the virtual time at which the last grant started."""

    def get(self, tenant: str) -> Share:
        return self.shares.get(tenant) or self.shares[FLEET]

    # -- quotas ------------------------------------------------------------------------------
    def open(self, share: Share, work: int) -> None:
        """Count one more open request of `work` tokens, or refuse it (in-flight requests,
        tokens/s) before any work; the caller calls `close` once it ends."""
        quotas = share.quotas
        if quotas.max_in_flight and share.in_flight >= quotas.max_in_flight:
            raise self._over(
                share, f"has {share.in_flight} requests open at the proxy (its quota max_in_flight is "
                f"{quotas.max_in_flight}); wait for some to finish"
            )  # fmt: skip
        if quotas.max_tokens_per_s and work:
            self._take_rate(share, work)
        share.in_flight += 1

    def close(self, share: Share) -> None:
        share.in_flight -= 1

    def check_queue(self, share: Share, work: int) -> None:
        """May `work` more tokens wait in the proxy's queue for this tenant? (its first may, however large)."""
        limit = share.quotas.max_queued_tokens
        if limit and share.queued_work and share.queued_work + work > limit:
            raise self._over(
                share, f"has {share.queued_work} tokens of work (n x max_new_tokens) waiting in the proxy's queue and "
                f"this request would take it over its quota max_queued_tokens of {limit}"
            )  # fmt: skip

    def _take_rate(self, share: Share, work: int) -> None:
        """The tokens/s quota as a bucket of `max_tokens_per_s` x RATE_WINDOW_S tokens, refilled
        at max_tokens_per_s; a request larger than the bucket passes when it is full."""
        rate = share.quotas.max_tokens_per_s
        capacity, now = rate * RATE_WINDOW_S, self.clock()
        bucket = capacity if share.bucket < 0 else min(capacity, share.bucket + (now - share.bucket_at) * rate)
        share.bucket_at = now
        if work > bucket and bucket < capacity:
            share.bucket = bucket
            wait = (min(work, capacity) - bucket) / rate
            raise self._over(
                share, f"asked for more than its quota max_tokens_per_s of {rate:g} allows now ({work} tokens of work: a "
                f"Generate's n x max_new_tokens, a Score's tokens; {bucket:.0f} left in its {RATE_WINDOW_S:g} s "
                f"window); retry in {wait:.1f} s",
                retry_after_s=max(self.retry_after_s, wait),
            )  # fmt: skip
        share.bucket = bucket - work

    def _over(self, share: Share, what: str, retry_after_s: float | None = None) -> ResourceExhausted:
        return ResourceExhausted(
            f"tenant {share.name} {what} (docs/deploy.md, Tenants)",
            reason=Reason.TENANT_QUOTA,
            retry_after_s=self.retry_after_s if retry_after_s is None else retry_after_s,
        )

    def check_spool(
        self,
        held: list[tuple[str, int, int]],
        name: str,
        version: int,
        size: int,
        keep: int,
        in_flight: Sequence[tuple[str, int, int]] = (),
        room: int = 0,
    ) -> None:
        """May the spool take version `version` (`size` bytes) of `name` (qualified) for its
        tenant, which holds `held` (name, version, bytes) now and has `in_flight` uploads (each
        counted as a version it holds, from its manifest on: a reservation is the tenant's)?
        Counted as the spool will hold it: a name already at `keep` versions drops its oldest;
        a version already spooled is no new one. `room`: the most bytes one tenant's uploads in
        flight may reserve together, whatever its quotas (0: no such bound)."""
        tenant, sep, _ = name.partition(TENANT_SEPARATOR)
        share = self.shares.get(tenant) if sep else None
        if share is None or any(n == name and v == version for n, v, _ in held):
            return
        pending = sum(b for _, _, b in in_flight)
        if room and pending + size > room:
            raise self._over(
                share, f"has {len(in_flight)} uploads of {pending} bytes in flight, and this one's {size} bytes would "
                f"take them over the {room} bytes one tenant may reserve in the spool at once; let them finish first",
                retry_after_s=self.retry_after_s,
            )  # fmt: skip
        held = [*held, *in_flight]
        quotas, mine = share.quotas, sorted((v, b) for n, v, b in held if n == name)
        dropped = mine[0][1] if len(mine) >= keep else None
        versions = len(held) + (0 if dropped is not None else 1)
        total = sum(b for _, _, b in held) + size - (dropped or 0)
        if quotas.max_spool_versions and versions > quotas.max_spool_versions:
            raise self._over(
                share, f"would hold {versions} adapter versions in the spool (its quota max_spool_versions is "
                f"{quotas.max_spool_versions}); unload or stop using some of its adapter names"
            )  # fmt: skip
        if quotas.max_spool_bytes and total > quotas.max_spool_bytes:
            raise self._over(
                share, f"would hold {total} bytes of adapters in the spool (its quota max_spool_bytes is "
                f"{quotas.max_spool_bytes}); push smaller adapters or use fewer names"
            )  # fmt: skip

    # -- fair share --------------------------------------------------------------------------
    def enqueued(self, share: Share, work: int) -> None:
        if not share.waiting:  # starts waiting: idle time is no credit
            share.vtime = max(share.vtime, self.vnow)
        share.waiting += 1
        share.queued_work += work

    def dequeued(self, share: Share, work: int) -> None:
        share.waiting -= 1
        share.queued_work -= work

    def granted(self, share: Share, work: int) -> None:
        self.vnow = max(self.vnow, share.vtime)
        share.vtime += work / share.weight


def check_spool_quota(shares: Shares, spool: Spool, keep: int, manifest: pb.AdapterManifest) -> None:
    """A push of `manifest` (a tenant's qualified name, or the fleet's: no quota) within its
    tenant's spool quotas, counted over what the spool holds of that tenant now; both doors
    ask this before any byte of the push is taken."""
    tenant, sep, _ = manifest.name.partition(TENANT_SEPARATOR)
    if not sep:
        return
    prefix = tenant + TENANT_SEPARATOR
    held = [(a.name, a.version, a.size) for n in spool.names() if n.startswith(prefix) for a in spool.versions(n)]
    room = int(spool.max_bytes * TENANT_UPLOAD_SHARE)
    m = manifest
    shares.check_spool(held, m.name, m.version, m.byte_length, keep, spool.in_flight(prefix), room)


def upload_room(shares: Shares, spool: Spool, tenant: str, arriving: int = 0) -> int:
    """At most how many bytes one more version of `tenant`'s ("" : the fleet's) could be given
    in the spool now: its room less the uploads in flight, and for a tenant its share of that
    room and its max_spool_bytes, less its own uploads in flight and `arriving` (the bytes of
    its uploads the door holds and has not yet handed to the spool). An upload larger is
    refused before it is held (the HTTP door); the exact check is the spool's admission
    (`check_spool_quota`)."""
    room = spool.max_bytes - spool.reserved - arriving
    share = shares.shares.get(tenant) if tenant else None
    if share is not None:
        pending = sum(b for _, _, b in spool.in_flight(tenant + TENANT_SEPARATOR)) + arriving
        room = min(room, int(spool.max_bytes * TENANT_UPLOAD_SHARE) - pending)
        if share.quotas.max_spool_bytes:
            room = min(room, share.quotas.max_spool_bytes - pending)
    return max(0, room)


TENANT_UPLOAD_SHARE = 0.5
"""The share of spool.max_bytes one tenant's uploads in flight may reserve at once (its quotas
aside): whatever one tenant holds open, the other half of the spool takes others' pushes."""
RATE_WINDOW_S = 10.0
"""The tokens/s quota is kept over this window: a tenant may burst this many seconds' worth."""
