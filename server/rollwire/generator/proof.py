"""A version's behavioural proof on one replica: its probe scored through this replica's engine
before the version is served (docs/protocol.md, "Proof").

The bytes of a version are checked on every hop (digests, signature); what the engine computes
with them is not: a served engine loads the file itself, an engine can keep an old adapter,
mis-scale one, or rebuild one wrongly. So a publisher attaches a probe (AdapterProbe: a few
token sequences and the logprobs its own forward gave them under the version) and this module
holds the replica to it. The registry (adapters.py) calls `Prover.prove` with the handle the
version was just loaded under, after the load and before the version becomes servable, on both
routes (a plain push and the commit of a staged one), catch-up included.

Invariants:
- a probe is checked whole before any payload byte is read (`check`: counts, sizes, finiteness,
  ids inside this model's vocabulary and context), so a malformed probe is the client's fault
  (INVALID_ARGUMENT) and never counts against the replica;
- the probe is scored through the engine's own Score path (engines/base.Scorer) under the new
  handle, off the event loop (the transformers engine's worker thread), at temperature 1;
- over the tolerance the version is refused (FAILED_PRECONDITION) with a sentence naming the
  gap, where it was and the tolerance, and the registry unloads it: the replica keeps serving
  exactly what it served. The refusal is PROOF_FAILED (the replica's fault) only when the
  probe's numbers are trustworthy: the signature covers the probe and this replica verified it
  (trust.keys_file set); otherwise PROOF_DISPUTED (either side may be wrong);
- an engine that cannot score serves the version, recorded as "unsupported" (never a pass);
- every outcome is counted (rollwire_generator_proofs_total{outcome}) and the last proof of each
  servable version is in GetStatus (LoadedAdapter.proofs).
"""

from __future__ import annotations

import time

from rollwire.common import probe as probes
from rollwire.common.errors import FailedPrecondition
from rollwire.common.manifest import Manifest
from rollwire.common.reasons import Reason
from rollwire.generator.engines.base import Engine, Scorer
from rollwire.generator.metrics import GeneratorMetrics
from rollwire.generator.types import AdapterSelection, ScoreJob
from rollwire.runtime.logs import get_logger
from rollwire.v1 import generator_pb2 as pb

log = get_logger(__name__)


class Prover:
    """Proves versions on one replica; see the module docstring."""

    def __init__(
        self, engine: Engine, metrics: GeneratorMetrics, *, tolerance: float = 0.0, trusted: bool, replica: str
    ) -> None:
        """`tolerance`: 0 takes the engine's default (rollwire.common.probe.DEFAULT_TOLERANCES);
        `trusted`: this replica verifies signatures (a signed probe's numbers are the publisher's)."""
        self.engine, self.metrics, self.replica = engine, metrics, replica
        self.tolerance = probes.tolerance_for(engine.name, tolerance)
        self.trusted = trusted
        self.proofs: dict[tuple[str, int], pb.AdapterProof] = {}
        """The last proof of each version proved here (pruned to the servable ones by `of`)."""

    def check(self, m: Manifest) -> None:
        """Refuse a probe this replica could never score (before any payload byte is read)."""
        if m.probe is not None:
            probes.check_probe(m.probe)
            probes.check_ids(m.probe, self.engine.vocab_size, self.engine.max_context)

    async def prove(self, handle: str, m: Manifest) -> None:
        """Score `m`'s probe under `handle` and refuse the version over the tolerance; no probe: nothing to do."""
        if m.probe is None:
            return
        if not isinstance(self.engine, Scorer):
            self._record(m, probes.UNSUPPORTED, probes.Gap(0.0))
            log.warning("adapter_proof_unsupported", adapter=m.name, version=m.version, engine=self.engine.name)
            return
        self.check(m)
        sequences = tuple((tuple(s.prompt_token_ids), tuple(s.continuation_token_ids)) for s in m.probe.sequences)
        job = ScoreJob(f"proof-{m.name}-v{m.version}", sequences, 0, AdapterSelection(m.name, m.version, handle))
        self.engine.check_score(job)
        started = time.monotonic()
        scores = await self.engine.score(job)
        self.metrics.proof_latency.observe(time.monotonic() - started)
        gap = probes.compare(probes.expected_of(m.probe), [s.logprobs for s in scores])
        signed = self.trusted and bool(m.signer)
        outcome = probes.PASSED if gap.within(self.tolerance) else probes.FAILED if signed else probes.DISPUTED
        self._record(m, outcome, gap)
        log.info(
            "adapter_proved" if outcome == probes.PASSED else "adapter_proof_refused",
            adapter=m.name,
            version=m.version,
            outcome=outcome,
            max_abs_gap=gap.max_abs,
            where=gap.where,
            tolerance=self.tolerance,
        )
        if outcome == probes.PASSED:
            return
        whose = (
            "the version's signed probe (so this replica computes another policy than the one published)"
            if signed
            else "the version's unsigned probe (either this engine or the publisher's numbers are wrong; sign the "
            "version so a receiver can tell)"
        )
        raise FailedPrecondition(
            f"replica {self.replica} ({self.engine.name}) refused adapter {m.name!r} v{m.version}: its engine's "
            f"logprobs differ by up to {gap.max_abs:.3g} (at {gap.where}) from {whose}, over its tolerance "
            f"{self.tolerance:g}; it keeps serving what it served. Check what this engine loaded (docs/protocol.md, "
            '"Proof")',
            reason=Reason.PROOF_FAILED if signed else Reason.PROOF_DISPUTED,
        )

    def _record(self, m: Manifest, outcome: str, gap: probes.Gap) -> None:
        self.metrics.proofs.labels(outcome).inc()
        self.metrics.proof_gap.labels(m.name).set(gap.max_abs)
        self.proofs[(m.name, m.version)] = pb.AdapterProof(
            outcome=outcome,
            max_abs_gap=gap.max_abs,
            where=gap.where,
            tolerance=self.tolerance,
            proved_at=time.time(),
            reference="publisher",
        )

    def of(self, loaded: dict[str, list[int]]) -> dict[str, dict[int, pb.AdapterProof]]:
        """The last proof of each servable version, per name (others are forgotten)."""
        keep = {(n, v) for n, vs in loaded.items() for v in vs}
        for key in [k for k in self.proofs if k not in keep]:
            del self.proofs[key]
        out: dict[str, dict[int, pb.AdapterProof]] = {}
        for (name, version), proof in self.proofs.items():
            out.setdefault(name, {})[version] = proof
        return out
