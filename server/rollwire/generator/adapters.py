"""Versioned LoRA adapters on one replica: the version window, staging, leases.

Invariants:
- versions of a name only increase; re-pushing a loaded version with the same digest is an
  idempotent success, anything else at or below the newest version is refused
  (`rollwire.common.manifest.check_push_version`, the rule the proxy's spool shares);
- the registry is handed only payloads that passed every check (rollwire.push.checks, the
  digest and the manifest rules), so a refused push leaves the replica serving exactly what
  it served before;
- a version staged by a `stage_only` push is loaded but never servable until committed
  with its digest, and is dropped when not committed within `stage_timeout_s`;
- the `keep` newest versions of each name are servable: a caller may name any of them. The
  `window` newest of those stay loaded in the engine; an older one is kept as its verified
  bytes (within `keep_bytes` over all names) and loaded again, under a fresh handle, when a
  request names it, then unloaded when its last request finishes. So the window is a cache
  of what callers may name, not a limit on it (TRL names up to max_staleness + 2 versions);
- a version older than the `keep` newest stops being servable at once and is unloaded from
  the engine when its last request finishes (leases);
- the engine holds at most `max_loaded` versions over all names (a served engine's LoRA
  slots; 0 = no limit) and a tenant's names at most its `tenant_slots`: before a load, the
  eviction policy (rollwire.generator.eviction, its invariants) unloads least recently used
  versions no request holds, keeping their bytes to load them again when named, or refuses a
  tenant whose every version is in use. Never by version number; `keep_bytes` lets go the
  least recently used bytes first too;
- engine handles are never reused, so no cache entry of an old policy can be served under
  a new version.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

from rollwire.common.errors import FailedPrecondition, NotFound
from rollwire.common.manifest import DEFAULT_MAX_VERSION_STEP, Manifest, check_push_version, identity
from rollwire.common.reasons import Reason
from rollwire.generator import eviction
from rollwire.generator.types import AdapterSelection
from rollwire.push.buffers import Payload

DEFAULT_STAGE_TIMEOUT_S = 300.0
"""A staged version not committed within this long is dropped (limits.stage_timeout_s)."""
DEFAULT_KEEP_BYTES = 2 << 30
"""Bytes of adapter payloads a replica keeps to load versions again (limits.adapter_keep_bytes)."""


@dataclass
class _Version:
    version: int
    sha256: str
    handle: str | None
    """The engine's handle while loaded; None while kept as bytes only."""
    manifest: Manifest | None = None
    payload: Payload | None = None
    """The verified bytes, kept while servable so the version can be loaded again."""
    leases: int = 0
    servable: bool = True
    used: int = 0  # the registry's tick when a request last took it (or it was pushed): LRU eviction


@dataclass
class PushOutcome:
    """What a push did: whether it was already there, and what is loaded now."""

    name: str
    version: int
    already_loaded: bool
    loaded_versions: list[int] = field(default_factory=list)
    staged: bool = False
    """True when the version was staged (not served until committed)."""


@dataclass
class _Staged:
    """A verified version loaded in the engine but not servable until committed."""

    version: int
    identity: str
    """Its sha256, or "blake3:" + its BLAKE3 when its manifest left the sha256 to the commit
    (rollwire.common.manifest.identity)."""
    handle: str
    manifest: Manifest | None = None
    payload: Payload | None = None
    expiry: asyncio.TimerHandle | None = None


class AdapterRegistry:
    """The replica's book of adapter versions; the engine holds the weights.

    `load(handle, manifest, payload)` and `unload(handle)` are the engine's calls. All
    bookkeeping runs on the event loop; a per-replica lock serialises pushes and commits.

    Staging (a `stage_only` push): a verified version is loaded into the engine under a
    fresh handle but is not servable: `acquire` and `loaded` never see it. At most one
    version per name is staged; another stage of that name replaces it. `commit` makes it servable
    exactly as a plain push would, provided the digest is the one staged and the version is
    still above the newest; a staged version not committed within `stage_timeout_s` is
    unloaded, so a publisher that died between stage and commit leaves nothing behind.
    """

    def __init__(
        self,
        load: Callable[[str, Manifest, Payload], Awaitable[None]],
        unload: Callable[[str], Awaitable[None]],
        window: int,
        stage_timeout_s: float = DEFAULT_STAGE_TIMEOUT_S,
        keep: int = 0,
        keep_bytes: int = DEFAULT_KEEP_BYTES,
        max_loaded: int = 0,
        tenant_slots: eviction.TenantSlotsSection | None = None,
        on_decision: Callable[[str], None] = lambda outcome: None,
        prove: Callable[[str, Manifest], Awaitable[None]] | None = None,
    ) -> None:
        """`keep`: versions of a name a caller may name (at least `window`; 0 = `window`);
        `keep_bytes`: the bytes of every servable version's payload held, over all names;
        `max_loaded`: versions the engine can hold at once over all names (0 = no limit);
        `tenant_slots`: versions one tenant's names may have loaded; `on_decision` is told each
        step of the eviction policy (eviction.OUTCOMES: the replica's metric); `prove(handle, manifest)`
        holds a loaded version to its probe before it becomes servable and raises to refuse it
        (generator/proof.py)."""
        self._prove = prove
        self._load, self._unload, self.window = load, unload, window
        self.keep, self.keep_bytes, self.max_loaded = max(keep, window), keep_bytes, max_loaded
        self.tenant_slots, self._on_decision = tenant_slots or eviction.TenantSlotsSection(), on_decision
        self._ticks = itertools.count(1)  # one per push and take: what `used` is measured in
        self.stage_timeout_s = stage_timeout_s
        self._versions: dict[str, list[_Version]] = {}
        self._newest: dict[str, int] = {}
        self._staged: dict[str, _Staged] = {}
        self._lock = asyncio.Lock()
        self._counter = 0
        self._pending_unloads: set[asyncio.Task] = set()
        self.on_servable: list[Callable[[str, int], None]] = []
        """Called (on the event loop) with (name, version) when a version becomes servable: the
        servicer moves the groups that follow `name` onto it."""

    def check_version(self, m: Manifest, max_step: int = DEFAULT_MAX_VERSION_STEP) -> bool:
        """True if this exact version is loaded (idempotent); raises if it may not be pushed."""
        same = next((v for v in self._versions.get(m.name, []) if v.version == m.version and v.servable), None)
        held_blake3 = same.manifest.blake3 if same is not None and same.manifest is not None else ""
        return check_push_version(
            m, self._newest.get(m.name, 0), same.sha256 if same else None, "replica", max_step, held_blake3
        )

    async def push(self, m: Manifest, payload: Payload, max_step: int = DEFAULT_MAX_VERSION_STEP) -> PushOutcome:
        """Load a checked payload as a new version and retire what leaves the window (a
        version staged with the same digest is committed without loading it again)."""
        async with self._lock:
            if self.check_version(m, max_step):
                return PushOutcome(m.name, m.version, True, self.loaded().get(m.name, []))
            assert m.sha256, "a new version is served under its sha256: its receiver names one the manifest left out"
            staged = self._staged.get(m.name)
            if staged is not None and (staged.version, staged.identity) == (m.version, identity(m)):
                await self._proven_staged(m.name, staged, m)
                return self._make_servable(m.name, self._unstage(m.name))
            handle = await self._load_new(m, payload)
            try:
                await self._proven(handle, m)
            except BaseException:
                await self._unload(handle)  # never servable: the replica keeps what it served
                raise
            return self._make_servable(m.name, _Staged(m.version, identity(m), handle, m, payload))

    async def stage(self, m: Manifest, payload: Payload, max_step: int = DEFAULT_MAX_VERSION_STEP) -> PushOutcome:
        """Load a checked payload without serving it; `commit` serves it. Staging the staged
        version again only restarts its timer; a version already served is an idempotent
        success (`already_loaded`, not staged)."""
        async with self._lock:
            if self.check_version(m, max_step):
                return PushOutcome(m.name, m.version, True, self.loaded().get(m.name, []))
            staged = self._staged.get(m.name)
            if staged is None or (staged.version, staged.identity) != (m.version, identity(m)):
                handle = await self._load_new(m, payload)
                self._drop_staged(m.name)
                staged = self._staged[m.name] = _Staged(m.version, identity(m), handle, m, payload)
            if staged.expiry is not None:
                staged.expiry.cancel()
            staged.expiry = asyncio.get_running_loop().call_later(
                self.stage_timeout_s, self._expire, m.name, staged.handle
            )
            return PushOutcome(m.name, m.version, False, self.loaded().get(m.name, []), staged=True)

    async def commit(self, name: str, version: int, sha256: str, blake3: str = "") -> PushOutcome:
        """Serve the staged `version` of `name`; idempotent once served with that digest.
        A version staged under its BLAKE3 (its manifest left the sha256 to the commit) is the
        one named when `blake3` is its BLAKE3, and is served with `sha256` as its identity: the
        committer (the proxy, admin) computed it from the bytes whose BLAKE3 this replica verified.
        FAILED_PRECONDITION when it is not staged with this digest (never staged, replaced,
        expired, or this replica restarted) or is no longer above the newest version."""
        async with self._lock:
            held = next((v for v in self._versions.get(name, []) if v.version == version and v.servable), None)
            if held is not None and held.sha256 == sha256:
                return PushOutcome(name, version, True, self.loaded().get(name, []))
            staged = self._staged.get(name)
            named = {sha256, f"blake3:{blake3}"} if blake3 else {sha256}
            if staged is None or staged.version != version or staged.identity not in named:
                now = f"v{staged.version} is staged" if staged else "nothing is staged"
                raise FailedPrecondition(
                    f"adapter {name!r} v{version} with this digest is not staged on this replica ({now}): it was never "
                    f"pushed here with stage_only, was replaced, or expired after {self.stage_timeout_s:g} s; "
                    "push it again",
                    reason=Reason.NOT_STAGED,
                )
            newest = self._newest.get(name, 0)
            if version <= newest:
                self._drop_staged(name)
                raise FailedPrecondition(
                    f"adapter {name!r} v{version} is not above the newest version v{newest} this replica serves "
                    f"(committed meanwhile); versions only increase, push v{newest + 1} or higher",
                    reason=Reason.VERSION_NOT_MONOTONIC,
                )
            await self._proven_staged(name, staged, staged.manifest)
            item = self._unstage(name)
            if item.identity != sha256:  # staged under its BLAKE3: the commit names its sha256
                item.identity = sha256
                item.manifest = replace(item.manifest, sha256=sha256) if item.manifest is not None else None
            return self._make_servable(name, item)

    async def _proven(self, handle: str, m: Manifest | None) -> None:
        """Hold a version loaded under `handle` to its probe (raises to refuse it)."""
        if self._prove is not None and m is not None:
            await self._prove(handle, m)

    async def _proven_staged(self, name: str, staged: _Staged, m: Manifest | None) -> None:
        """`_proven` for a staged version: a refused proof drops the stage (the same bytes give the
        same numbers: a commit again would fail again); another failure (an engine's OOM) keeps it."""
        try:
            await self._proven(staged.handle, m)
        except FailedPrecondition as err:
            if err.reason in (Reason.PROOF_FAILED, Reason.PROOF_DISPUTED):
                self._drop_staged(name)
            raise

    def staged(self) -> dict[str, int]:
        """The staged (not servable) version of each name."""
        return {name: s.version for name, s in self._staged.items()}

    async def _load_new(self, m: Manifest, payload: Payload) -> str:
        await self._make_room(m.name)
        self._counter += 1
        handle = f"rw{self._counter}"
        await self._load(handle, m, payload)
        return handle

    async def _make_room(self, name: str) -> None:
        """Room for a version of `name` within the engine's slots and its tenant's, as the
        eviction policy decides step by step; raises its refusal (TENANT_SLOTS_FULL). When every
        version serves a request the engine decides (served: ADAPTER_SLOTS_FULL)."""
        while True:
            loaded = [(n, v) for n, vs in self._versions.items() for v in vs if v.handle is not None]
            step = eviction.decide(name, loaded, self._staged, self.tenant_slots, self.max_loaded)
            self._on_decision(step.outcome)
            if step.outcome == eviction.QUOTA_REFUSED:
                raise eviction.quota_refusal(name, step, self.tenant_slots)
            if step.victim is None:
                return
            handle, step.victim.handle = step.victim.handle or "", None
            await self._unload(handle)

    def _make_servable(self, name: str, item: _Staged) -> PushOutcome:
        versions = self._versions.setdefault(name, [])
        versions.append(_Version(item.version, item.identity, item.handle, item.manifest, item.payload))
        versions[-1].used = next(self._ticks)
        self._newest[name] = item.version
        self._retire(name)
        staged = self._staged.get(name)
        if staged is not None and staged.version <= item.version:
            self._drop_staged(name)  # it can never be committed now: versions only increase
        for listener in self.on_servable:
            listener(name, item.version)
        return PushOutcome(name, item.version, False, self.loaded().get(name, []))

    def _retire(self, name: str) -> None:
        """Keep the `keep` newest versions servable (an older one outside the window only with
        its bytes), the `window` newest loaded, and the kept bytes within `keep_bytes`."""
        servable = [v for v in self._versions.get(name, []) if v.servable]
        for age, v in enumerate(reversed(servable)):  # newest first
            if age >= self.keep or (age >= self.window and v.payload is None):
                v.servable, v.payload = False, None
            self._maybe_unload(name, v)
        held = sum(len(v.payload) for vs in self._versions.values() for v in vs if v.payload is not None)
        for n, v in self._oldest_kept():
            if held <= self.keep_bytes:
                break
            held -= len(v.payload or b"")
            v.servable, v.payload = False, None
            self._maybe_unload(n, v)

    def _oldest_kept(self) -> list[tuple[str, _Version]]:
        """Servable versions outside their window, least recently used first: what `keep_bytes`
        lets go first (by use, not by version number: names' version numbers do not compare)."""
        out = []
        for name, versions in self._versions.items():
            servable = [v for v in versions if v.servable]
            out += [(name, v) for v in servable[: max(0, len(servable) - self.window)]]
        return sorted(out, key=lambda item: (item[1].used, item[1].version))

    def _in_window(self, name: str, v: _Version) -> bool:
        servable = [x for x in self._versions.get(name, []) if x.servable]
        return v in servable[-self.window :]

    def _unstage(self, name: str) -> _Staged:
        item = self._staged.pop(name)
        if item.expiry is not None:
            item.expiry.cancel()
        return item

    def _drop_staged(self, name: str) -> None:
        if name in self._staged:
            self._unload_later(self._unstage(name).handle)

    def _expire(self, name: str, handle: str) -> None:
        staged = self._staged.get(name)
        if staged is not None and staged.handle == handle:
            self._drop_staged(name)

    def _unload_later(self, handle: str) -> None:
        task = asyncio.ensure_future(self._unload(handle))
        self._pending_unloads.add(task)
        task.add_done_callback(self._pending_unloads.discard)

    async def take(self, name: str, version: int) -> AdapterSelection:
        """`acquire`, loading a kept version into the engine again first (under a fresh handle)."""
        if not name:
            return AdapterSelection()
        chosen = self._choose(name, version)
        if chosen.handle is None:
            async with self._lock:  # pushes and other loads wait; the version cannot leave meanwhile
                chosen = self._choose(name, version)
                if chosen.handle is None and chosen.manifest is not None and chosen.payload is not None:
                    chosen.handle = await self._load_new(chosen.manifest, chosen.payload)
        return self.acquire(name, chosen.version)

    def acquire(self, name: str, version: int) -> AdapterSelection:
        """Resolve a request's loaded adapter (version 0 = newest) and hold it until release;
        a kept version must be taken with `take`, which loads it."""
        if not name:
            return AdapterSelection()
        chosen = self._choose(name, version)
        if chosen.handle is None:
            raise FailedPrecondition(
                f"adapter {name!r} v{chosen.version} is kept but not loaded on this replica; take it (it loads it)",
                reason=Reason.ADAPTER_VERSION_EVICTED,
            )
        chosen.leases += 1
        chosen.used = next(self._ticks)
        return AdapterSelection(name, chosen.version, chosen.handle)

    def _choose(self, name: str, version: int) -> _Version:
        versions = [v for v in self._versions.get(name, []) if v.servable]
        if not versions:  # never the names it holds: they are other callers' (GetStatus lists them to whom it may)
            raise NotFound(
                f"no adapter named {name[:256]!r} is loaded on this replica; push it first",
                reason=Reason.ADAPTER_NOT_FOUND,
            )
        if version == 0:
            chosen = versions[-1]
        else:
            chosen = next((v for v in versions if v.version == version), None)
            if chosen is None:
                loaded = ", ".join(str(v.version) for v in versions)
                if version < versions[0].version:
                    raise FailedPrecondition(
                        f"adapter {name!r} v{version} is older than the {self.keep} newest versions this replica keeps "
                        f"(servable: {loaded}); request a newer version or the latest, or raise the replicas' "
                        "adapter_keep",
                        reason=Reason.ADAPTER_VERSION_EVICTED,
                    )
                raise NotFound(
                    f"adapter {name!r} v{version} is not loaded on this replica (loaded: {loaded}); "
                    "it has not been pushed here yet",
                    reason=Reason.ADAPTER_VERSION_NOT_FOUND,
                )
        return chosen

    def release(self, sel: AdapterSelection) -> None:
        """End a request's hold; unloads a retired version when its last request ends."""
        if sel.handle is None:
            return
        for v in self._versions.get(sel.name, []):
            if v.handle == sel.handle:
                v.leases -= 1
                self._maybe_unload(sel.name, v)
                return

    def newest(self, name: str) -> int:
        """The newest version of `name` committed here (0: none)."""
        return self._newest.get(name, 0)

    def loaded(self) -> dict[str, list[int]]:
        """Servable versions per name, oldest first."""
        out = {}
        for name, versions in self._versions.items():
            servable = [v.version for v in versions if v.servable]
            if servable:
                out[name] = servable
        return out

    def digests(self) -> dict[str, dict[int, str]]:
        """The sha256 of every servable version, per name: what GetStatus reports, so a proxy can
        tell a version held here with other bytes than its own."""
        return {
            name: {v.version: v.sha256 for v in versions if v.servable}
            for name, versions in self._versions.items()
            if any(v.servable for v in versions)
        }

    def signers(self) -> dict[str, dict[int, str]]:
        """The key id that signed each servable version, per name (unsigned ones left out):
        what GetStatus reports beside the digests (rollwire.common.signing)."""
        out: dict[str, dict[int, str]] = {}
        for name, versions in self._versions.items():
            signed = {v.version: v.manifest.signer for v in versions if v.servable and v.manifest and v.manifest.signer}
            if signed:
                out[name] = signed
        return out

    def _maybe_unload(self, name: str, v: _Version) -> None:
        """Once no request holds it: forget a version that is no longer servable; unload a kept
        one that left the window (its bytes stay, to load it again)."""
        if v.leases > 0:
            return
        if not v.servable:
            self._versions[name].remove(v)
        elif v.handle is None or self._in_window(name, v):
            return
        if v.handle is not None:
            self._unload_later(v.handle)
            v.handle = None

    async def settle(self) -> None:
        """Wait for pending unloads (tests and shutdown)."""
        while self._pending_unloads:
            await asyncio.gather(*list(self._pending_unloads), return_exceptions=True)
