"""A fake of the learner's target: the calls a learner makes of a proxy or a replica through its
AsyncClient (get_status, generate, push_adapter, close), answered in-process, so the learner's
own logic (opening and resuming a run, the loop's accounting) is tested without processes or
sockets (wiring.open_session takes it as `client`).

What it keeps of the real target's contract, and nothing more:
- it serves one base model (by fingerprint) and refuses a push for another (FailedPrecondition);
- an adapter's versions only go up: a push at or below the newest is refused with
  VERSION_NOT_MONOTONIC, as a replica does (the rule a resumed learner must respect);
- `name@latest` samples with the newest pushed version, and each sample says so;
- a prompt's answer is the test's: completion texts, or an exception to raise (the typed
  errors the SDK raises for a refused or failed call);
- each accepted push is kept as the SDK would send it: its manifest built by the SDK's own
  `build_manifest` (probe and signature included) and its payload, so a test can hand a version
  to a real replica's registry and see it proved.
What a replica does over a socket (streams, restarts, deadlines) is tested with real processes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

from rollwire.client._push import build_manifest
from rollwire.client._requests import AdapterVersion
from rollwire.client._results import GenerateResult, Sample
from rollwire.common.errors import FailedPrecondition
from rollwire.common.reasons import Reason
from rollwire.v1 import generator_pb2 as pb

Answer = Callable[[str], "list[str] | Exception"]
"""A prompt's answer: the texts of its samples, or the exception the call raises."""


@dataclass
class FakeTarget:
    fingerprint: str
    answer: Answer
    adapter_name: str = "policy"
    versions: list[int] = field(default_factory=list)
    """The versions of `adapter_name` the target holds, oldest first (a test may seed them)."""
    requests: list[tuple[str, dict]] = field(default_factory=list)
    pushed: list[int] = field(default_factory=list)
    manifests: dict[int, pb.AdapterManifest] = field(default_factory=dict)
    """Each accepted version's manifest, as the SDK builds it."""
    payloads: dict[int, bytes] = field(default_factory=dict)
    closed: bool = False

    async def get_status(self):
        adapters = [SimpleNamespace(name=self.adapter_name, versions=list(self.versions))] if self.versions else []
        return SimpleNamespace(model_fingerprint=self.fingerprint, adapters=adapters, replicas=[])

    async def push_adapter(
        self, name, version, payload, lora, fingerprint, *, signing_key=None, sha256_by_receiver=False, probe=None
    ):
        manifest = build_manifest(name, version, payload, lora, fingerprint, signing_key, sha256_by_receiver, probe)
        if fingerprint != self.fingerprint:
            raise FailedPrecondition(f"base model {fingerprint} is not {self.fingerprint}")
        if name == self.adapter_name and self.versions and version <= self.versions[-1]:
            raise FailedPrecondition(
                f"{name} v{version} is not above v{self.versions[-1]}", reason=Reason.VERSION_NOT_MONOTONIC
            )
        self.versions.append(version)
        self.pushed.append(version)
        self.manifests[version], self.payloads[version] = manifest, bytes(payload)
        return SimpleNamespace(replicas=[], already_loaded=False)

    async def generate(self, prompt: str, n: int, **options) -> GenerateResult:
        self.requests.append((prompt, options))
        answer = self.answer(prompt)
        if isinstance(answer, Exception):
            raise answer
        version = self.versions[-1] if self.versions else 0
        samples = [
            Sample(i, [5 + i, 2], [-0.7, -0.1], text, "eos", self.adapter_name, version, [version, version], 4, 2)
            for i, text in zip(range(n), answer * n, strict=False)
        ]
        return GenerateResult(
            "fake", "fake-replica", AdapterVersion(self.adapter_name, version), [7, 8, 9, 10], samples
        )

    async def close(self) -> None:
        self.closed = True
