"""The one base model a proxy's fleet serves: declared, or agreed by the spool, never learned
from a member.

Invariants:
- the expected fingerprint is `base_model` from the proxy's config when set; else the
  fingerprint every spooled version's manifest names (checked at start: versions of two
  base models without a declaration refuse the start, naming both); else the fingerprint of
  the first version a push spooled. Once known it never changes for the life of the process,
  and no replica's answer ever sets it;
- a spooled version of another base model than the declared one is quarantined at start
  (no replica of the fleet could ever serve it);
- linear-layer shapes, which push checks need, are taken only from members serving the
  expected base model (before one is known: from members serving the push's own);
- a member serving another base model is refused membership (replicas.py): never routed to,
  pushed to, caught up, or counted in a quarantine quorum.
"""

from __future__ import annotations

from rollwire.common.errors import FailedPrecondition, Unavailable
from rollwire.common.reasons import Reason
from rollwire.proxy.spool import Spool

Shapes = dict[str, tuple[int, int]]


class BaseModel:
    """What the fleet serves, and why this proxy believes it (`source`)."""

    def __init__(self, declared: str, spool: Spool) -> None:
        self.fingerprint, self.source = "", ""
        self.shapes: dict[str, Shapes] = {}
        """Linear-layer shapes by fingerprint, as members serving it reported them."""
        if declared:
            self.fingerprint, self.source = declared, "declared in the proxy's config (base_model)"
            for adapter in [a for n in spool.names() for a in spool.versions(n)]:
                if adapter.manifest.base_model_fingerprint != declared:
                    spool.quarantine(
                        adapter,
                        f"it was trained on base model {adapter.manifest.base_model_fingerprint} but this proxy's "
                        f"config declares {declared} (base_model)",
                    )
            return
        named: dict[str, list[str]] = {}
        for adapter in [a for n in spool.names() for a in spool.versions(n)]:
            named.setdefault(adapter.manifest.base_model_fingerprint, []).append(f"{adapter.name} v{adapter.version}")
        if len(named) > 1:
            which = "; ".join(f"{fp}: {', '.join(vs[:4])}" for fp, vs in sorted(named.items()))
            raise FailedPrecondition(
                f"the spool {spool.folder} holds versions of {len(named)} base models ({which}); set base_model in "
                "the proxy's config to the one the replicas serve (the others are then quarantined)",
                reason=Reason.BASE_MODEL_MISMATCH,
            )
        if named:
            self.fingerprint, self.source = next(iter(named)), "agreed by the spooled versions' manifests"

    def adopt(self, fingerprint: str) -> None:
        """A version of `fingerprint` was spooled: that is the fleet's base model from now on."""
        if not self.fingerprint:
            self.fingerprint, self.source = fingerprint, "agreed by the first version pushed"

    def report(self, fingerprint: str, shapes: Shapes) -> None:
        """A member serving `fingerprint` reported its linear layers (kept once per fingerprint;
        a fleet has few)."""
        if shapes and fingerprint not in self.shapes and len(self.shapes) < 16:
            self.shapes[fingerprint] = shapes

    def foreign(self, fingerprint: str) -> bool:
        """A member serving `fingerprint` is not of this fleet."""
        return bool(self.fingerprint) and fingerprint != self.fingerprint

    def refusal(self, name: str, address: str, fingerprint: str) -> str:
        """Why a member is refused membership, naming it, for status, logs and errors."""
        return (
            f"refused membership: replica {name} ({address}) serves base model {fingerprint or '(none)'} but this "
            f"fleet serves {self.fingerprint} ({self.source}); point it at the fleet's model folder, or remove it"
        )

    def basis(self, pushed: str, serving: set[str], describe: str, retry_after_s: float) -> tuple[str, Shapes]:
        """(fingerprint, base shapes) a push trained on `pushed` is checked against. `serving`
        is the fingerprints healthy members serve now. A push of another base model than the
        fleet's is refused by the manifest check that follows (BASE_MODEL_MISMATCH)."""
        expected = self.fingerprint or pushed
        shapes = self.shapes.get(expected)
        if expected in serving and shapes:
            return expected, shapes
        if self.fingerprint or not serving:
            raise Unavailable(
                f"no generator replica serving base model {expected} has reported yet ({describe}); nothing was "
                "applied, retry when one is up",
                reason=Reason.NO_REPLICA,
                retry_after_s=retry_after_s,
            )
        raise FailedPrecondition(
            f"the adapter was trained on base model {pushed or '(none given)'}, which no replica serves (they serve "
            f"{', '.join(sorted(serving))}); push an adapter of the base model the replicas serve",
            reason=Reason.BASE_MODEL_MISMATCH,
        )
