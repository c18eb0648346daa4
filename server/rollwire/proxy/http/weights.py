"""/weight_info: which policy each replica computes, shaped like vLLM's weight checker's answer.

vLLM's checker (POST /weight_checker, action "compare") answers `{"match": bool, "mismatches":
[key]}` for the parameters of the one server asked, and checks no LoRA adapter. Here the keys
are `REPLICA:NAME:vVERSION` over the whole fleet, and what is compared is behaviour: each
version's last proof on each replica (proxy/publish/proof.py; docs/protocol.md, "Proof").

GET /weight_info answers `match` (no replica failed a proof), `mismatches` (the versions a replica
failed, the replica's fault) and `disputed`, and for an admin `replicas`: per replica and version
the digest, the signer and the last proof (outcome, max |Δlogprob|, where, tolerance, when,
against whose numbers); other callers get the verdict without the fleet's topology (GetStatus's
rule). POST /weight_info re-checks every version now first (AdminService.ProveAdapters): an
admin's call, since it sends Score traffic to every replica.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rollwire.common import probe as probes
from rollwire.common.errors import PermissionDenied
from rollwire.common.reasons import Reason
from rollwire.runtime.security import ADMIN, GENERATE
from rollwire.v1 import generator_pb2 as pb


def weight_info(status: pb.GetStatusResponse, topology: bool) -> dict[str, Any]:
    """The fleet's proofs from a proxy's GetStatus (the module docstring)."""
    digests = {(a.name, v): d for a in status.adapters for v, d in a.digests.items()}
    signers = {(a.name, v): k for a in status.adapters for v, k in a.signers.items()}
    mismatches, disputed, replicas = [], [], []
    for r in status.replicas:
        who = r.replica or r.address
        entries = []
        for a in r.adapters:
            for version, p in sorted(a.proofs.items()):
                key = f"{who}:{a.name}:v{version}"
                if p.outcome == probes.FAILED:
                    mismatches.append(key)
                elif p.outcome == probes.DISPUTED:
                    disputed.append(key)
                entries.append(
                    {
                        "name": a.name,
                        "version": version,
                        "routed": version in a.versions,
                        "sha256": digests.get((a.name, version), ""),
                        "signer": signers.get((a.name, version), ""),
                        "proof": {
                            "outcome": p.outcome,
                            "max_abs_logprob_gap": p.max_abs_gap,
                            "where": p.where,
                            "tolerance": p.tolerance,
                            "proved_at": p.proved_at,
                            "reference": p.reference,
                        },
                    }
                )
        replicas.append({"replica": who, "address": r.address, "adapters": entries})
    out: dict[str, Any] = {"match": not mismatches, "mismatches": mismatches, "disputed": disputed}
    if topology:
        out["replicas"] = replicas
    return out


def proof_summary(status: pb.GetStatusResponse) -> dict[tuple[str, int], dict[str, Any]]:
    """Per (name, version): how many replicas' last proofs are in each outcome and the largest gap
    (what /v1/models entries show: no replica named)."""
    out: dict[tuple[str, int], dict[str, Any]] = {}
    for r in status.replicas:
        for a in r.adapters:
            for version, p in a.proofs.items():
                entry = out.setdefault((a.name, version), {"outcomes": {}, "max_abs_logprob_gap": 0.0})
                entry["outcomes"][p.outcome] = entry["outcomes"].get(p.outcome, 0) + 1
                entry["max_abs_logprob_gap"] = max(entry["max_abs_logprob_gap"], p.max_abs_gap)
    return out


def add_weight_routes(app: FastAPI, door: Any, authorize: Callable[[Any, Request, str], str]) -> None:
    """GET and POST /weight_info on the door's app (`authorize`: app.py's role check)."""

    @app.get("/weight_info")
    async def read(request: Request) -> JSONResponse:
        authorize(door, request, GENERATE)
        return JSONResponse(weight_info(door.core.status(), request.state.role == ADMIN))

    @app.post("/weight_info")
    async def recheck(request: Request) -> JSONResponse:
        authorize(door, request, ADMIN)
        if request.state.role != ADMIN:  # a tenant's publish role passes ADMIN routes for its own adapters only
            raise PermissionDenied(
                "re-checking the fleet's versions sends Score traffic to every replica: it needs an admin token",
                reason=Reason.WRONG_ROLE,
            )
        await door.core.prove()
        return JSONResponse(weight_info(door.core.status(), True))
