"""Proofs after commit: each replica's engine re-checked against a version's probe, on demand,
on a period and after every commit (docs/protocol.md, "Proof").

A replica proves a version with a publisher's probe before it serves it (rollwire.generator.proof);
this module keeps asking afterwards, because a version can drift after its commit (an adapter
evicted and rebuilt wrongly, a served engine's server restarted with another file). A re-check is
one Score of the probe's sequences under (name, version) on one replica, compared with the
reference numbers.

The reference of a version:
- the publisher's probe (AdapterManifest.probe in the spool's manifest), trusted when this proxy
  verifies signatures (trust.keys_file) and the manifest is signed: the signature covers it;
- for a version published without one, the proxy's own: after the commit it scores fixed token
  sequences (rollwire.common.probe.fixed_sequences) on the first replica that committed it and
  holds the others to those numbers, so a fleet that disagrees with itself is visible.

Invariants:
- a re-check is background work: bounded (`proof.max_concurrent` Scores at once, each within
  `proof.timeout_s`), never on a request's path, and a replica that cannot answer (down,
  overloaded, an engine that cannot score) is not judged: only a Score's numbers are;
- only a gap over the tolerance against a trusted reference (a signed publisher's probe) is the
  replica's fault: that version is no longer routed there (Replica.disproved) until a re-check
  passes again; a gap against an unsigned probe or another replica's numbers is "disputed",
  shown and counted, and changes no routing (one of the two sides is wrong, and a client's or a
  peer's bad numbers must never take a replica out);
- every outcome is counted per replica (rollwire_proxy_adapter_proofs_total) and its gap set
  (rollwire_proxy_adapter_proof_gap); the last re-check of each version is in the replica's
  status (LoadedAdapter.proofs), which `rollwire status` and the HTTP door's /weight_info show.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

import grpc

from rollwire.common import probe as probes
from rollwire.common.manifest import TENANT_SEPARATOR
from rollwire.proxy.config import ProxyConfig
from rollwire.proxy.fleet.replica import Replica
from rollwire.proxy.fleet.replicas import ReplicaSet
from rollwire.proxy.metrics import ProxyMetrics
from rollwire.proxy.spool import Spool
from rollwire.runtime.logs import REQUEST_ID_KEY, get_logger
from rollwire.v1 import generator_pb2 as pb

log = get_logger(__name__)
MAX_DERIVED = 4096
"""References the proxy made itself, kept at most (the oldest go first: a version left the spool by then)."""


@dataclass(frozen=True)
class Reference:
    """The numbers a version is held to, and whose they are."""

    probe: pb.AdapterProbe
    source: str
    """"publisher", or "replica NAME" for one the proxy made from that replica."""
    trusted: bool
    """The publisher signed them and this proxy verifies signatures: a gap is the replica's fault."""


class ProofBook:
    """The proxy's proofs of each version on each replica; see the module docstring."""

    def __init__(self, spool: Spool, replicas: ReplicaSet, config: ProxyConfig, metrics: ProxyMetrics) -> None:
        self.spool, self.replicas, self.config, self.metrics = spool, replicas, config, metrics
        self.section = config.proof
        self.verifies = config.trust.trusted().required
        self._derived: dict[tuple[str, int], Reference] = {}
        self._slots = asyncio.Semaphore(self.section.max_concurrent)
        self._tasks: set[asyncio.Task] = set()
        self.runs = 0
        """Re-check rounds finished (after commits, on demand, on the period): what tests await."""
        self._round = asyncio.Condition()

    # -- references ----------------------------------------------------------------------
    def reference(self, name: str, version: int) -> Reference | None:
        spooled = self.spool.get(name, version)
        if spooled is not None and spooled.manifest.HasField("probe"):
            m = spooled.manifest
            return Reference(m.probe, "publisher", self.verifies and bool(m.signature))
        return self._derived.get((name, version))

    async def _derive(self, replica: Replica, name: str, version: int) -> Reference | None:
        """The proxy's reference for an unprobed version: fixed sequences scored on `replica`."""
        sequences = probes.fixed_sequences(seed=version)
        request = pb.ScoreRequest(
            adapter=pb.AdapterRef(name=name, version=version),
            sequences=[pb.ScoreSequence(prompt_token_ids=p, continuation_token_ids=c) for p, c in sequences],
        )
        reply = await self._score(replica, request)
        if reply is None:
            return None
        probe = probes.build_probe(sequences, [list(s.logprobs) for s in reply.sequences], seed=version)
        ref = Reference(probe, f"replica {replica.name}", trusted=False)
        self._derived[(name, version)] = ref
        while len(self._derived) > MAX_DERIVED:
            del self._derived[next(iter(self._derived))]
        return ref

    # -- checks --------------------------------------------------------------------------
    def after_commit(self, manifest: pb.AdapterManifest, committed: list[Replica]) -> None:
        """Re-check a version just committed on `committed` (in the background)."""
        if committed:
            self._spawn(self._after_commit(manifest.name, manifest.version, committed))

    async def _after_commit(self, name: str, version: int, committed: list[Replica]) -> None:
        ref = self.reference(name, version)
        first = committed[0]
        if ref is None:
            ref = await self._derive(first, name, version)
            if ref is None:
                await self._finished()
                return
            self._record(first, name, version, ref, probes.PASSED, probes.Gap(0.0))  # the reference itself
            committed = committed[1:]
        await asyncio.gather(*(self.prove(r, name, version, ref) for r in committed))
        await self._finished()

    async def prove_all(self, name: str = "") -> list[Replica]:
        """Re-check every version with a reference on every routable replica (and the versions a
        replica failed, so it can pass again); the replicas checked."""
        checked = []
        jobs = []
        for replica in self.replicas.all():
            if not replica.routable():
                continue
            held = {(n, v) for n, vs in replica.versions.items() for v in vs} | set(replica.disproved)
            targets = [(n, v) for n, v in sorted(held) if not name or n == name]
            refs = [(n, v, ref) for n, v in targets if (ref := self.reference(n, v)) is not None]
            if refs:
                checked.append(replica)
                jobs += [self.prove(replica, n, v, ref) for n, v, ref in refs]
        await asyncio.gather(*jobs)
        await self._finished()
        return checked

    async def prove(self, replica: Replica, name: str, version: int, ref: Reference) -> pb.AdapterProof | None:
        """One re-check: the probe's Score on `replica`, judged (the module's invariants)."""
        reply = await self._score(replica, probes.score_request(ref.probe, name, version))
        if reply is None:
            return replica.proofs.get((name, version))
        if reply.adapter.version != version:  # never judged on another version's numbers
            return None
        gap = probes.compare(probes.expected_of(ref.probe), [list(s.logprobs) for s in reply.sequences])
        tolerance = probes.tolerance_for(replica.engine, self.section.tolerance)
        if gap.within(tolerance):
            outcome = probes.PASSED
        else:
            outcome = probes.FAILED if ref.source == "publisher" and ref.trusted else probes.DISPUTED
        return self._record(replica, name, version, ref, outcome, gap, tolerance)

    async def _score(self, replica: Replica, request: pb.ScoreRequest) -> pb.ScoreResponse | None:
        """The replica's Score, or None where it could not answer (never judged: not its numbers)."""
        name, version = request.adapter.name, request.adapter.version
        rid = f"proof-{name}-v{version}-{replica.address}"
        async with self._slots:
            try:
                return await replica.generator.Score(
                    request, timeout=self.section.timeout_s, metadata=((REQUEST_ID_KEY, rid), *replica.metadata)
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    self._record(replica, name, version, None, probes.UNSUPPORTED, probes.Gap(0.0))
                else:
                    log.info(
                        "adapter_proof_unanswered",
                        replica=replica.address,
                        adapter=name,
                        version=version,
                        code=exc.code().name,
                        error=(exc.details() or "")[:200],
                    )
                return None

    def _record(
        self,
        replica: Replica,
        name: str,
        version: int,
        ref: Reference | None,
        outcome: str,
        gap: probes.Gap,
        tolerance: float = 0.0,
    ) -> pb.AdapterProof:
        proof = pb.AdapterProof(
            outcome=outcome,
            max_abs_gap=gap.max_abs if math.isfinite(gap.max_abs) else 1e30,
            where=gap.where,
            tolerance=tolerance or probes.tolerance_for(replica.engine, self.section.tolerance),
            proved_at=time.time(),
            reference=ref.source if ref is not None else "",
        )
        replica.proofs[(name, version)] = proof
        self.metrics.proofs.labels(replica.address, outcome).inc()
        label = _adapter_label(name)
        self.metrics.proof_gap.labels(replica.address, label).set(proof.max_abs_gap)
        self.metrics.proof_version.labels(replica.address, label).set(version)
        key = (name, version)
        if outcome == probes.FAILED:
            why = (
                f"its engine's logprobs for {name!r} v{version} differ by up to {gap.max_abs:.3g} (at {gap.where}) from "
                f"the publisher's signed probe, over its tolerance {proof.tolerance:g}"
            )
            if key not in replica.disproved:
                log.error("adapter_proof_failed", replica=replica.address, adapter=name, version=version, why=why)
            replica.disproved[key] = why
            replica.set_versions(name, replica.versions.get(name, []))
            self.replicas.on_change()
        elif outcome == probes.DISPUTED:
            log.warning(
                "adapter_proof_disputed",
                replica=replica.address,
                adapter=name,
                version=version,
                max_abs_gap=gap.max_abs,
                where=gap.where,
                reference=proof.reference,
            )
        elif outcome == probes.PASSED and replica.disproved.pop(key, None) is not None:
            log.info("adapter_proof_recovered", replica=replica.address, adapter=name, version=version)
            # it just scored under that very version (the reply said so): it holds it, routed again
            replica.set_versions(name, sorted({*replica.versions.get(name, []), version}))
            self.replicas.on_change()
        return proof

    # -- rounds --------------------------------------------------------------------------
    async def run(self) -> None:
        """Re-check everything every `proof.recheck_interval_s` (until cancelled)."""
        interval = self.section.recheck_interval_s
        if interval <= 0:
            return
        while True:
            await asyncio.sleep(interval)
            try:
                await self.prove_all()
            except Exception:  # one bad round must not end the loop
                log.exception("adapter_proof_round_failed")

    async def wait_rounds(self, count: int, timeout: float) -> None:
        """Until `count` rounds have finished (tests; after_commit's rounds count too)."""
        async with self._round:
            await asyncio.wait_for(self._round.wait_for(lambda: self.runs >= count), timeout)

    async def _finished(self) -> None:
        async with self._round:
            self.runs += 1
            self._round.notify_all()

    def _spawn(self, work) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _adapter_label(name: str) -> str:
    """A metric's adapter label: a shared name as it is, a tenant's as TENANT:* (bounded by the config)."""
    tenant, sep, _ = name.partition(TENANT_SEPARATOR)
    return f"{tenant}{TENANT_SEPARATOR}*" if sep else name
