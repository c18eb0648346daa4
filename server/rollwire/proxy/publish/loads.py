"""Publishing by name: the load, lineage and unload rules, whichever door asked (the core's
`load` and `unload` verbs, core.py). A load is one push through FanOut.push, exactly as a gRPC
PushAdapter to the proxy is: checked, spooled, relayed to every replica, healed, caught up by
late joiners and shared with peer proxies.

Invariants:
- the load answers once the version is durable in the spool (`http.load_answer = "spooled"`,
  the default: the relay and commit finish behind the answer, and a request naming the version
  waits for a replica that serves it) or once it is committed (`"committed"`), or with the
  refusal the push met;
- a version keeps its bytes: NAME's version N loaded again with the same bytes is an idempotent
  success; v1 with other bytes than the v1 of NAME's current lineage, once that lineage has a
  version, starts a new lineage (a new run: lineages.py), published under an internal name no
  replica has seen, to which NAME then maps for every caller; any other version with other bytes
  is refused by the spool (VERSION_CONFLICT), as within one run it is a mistake;
- an unload is durable and fleet-wide (lineages.py, in the spool, and shared with every peer
  proxy before it answers: a peer that is down is marked behind and gets it when caught up):
  the version is never served again by name or as "latest", by either door of any proxy, nor
  listed, until it is loaded again; unloading what the fleet never had is NOT_FOUND. The
  replicas' windows move on by themselves as newer versions arrive, so nothing needs unloading
  there;
- a new lineage is told to peer proxies once its first version is in their spools (after the
  publication's share), so no peer routes NAME to a lineage it cannot serve;
- loads of one name run one at a time (each picks its version and lineage, then publishes
  under it); the lock is dropped when the last load of the name ends (audit A16).

Names here are the fleet's (a tenant's already qualified by the core); nothing here knows
which door a load came by.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from rollwire.common.digest import payload_digests
from rollwire.common.errors import FailedPrecondition, InvalidArgument, NotFound
from rollwire.common.lora import LoraShape
from rollwire.common.manifest import check_name
from rollwire.common.reasons import Reason
from rollwire.common.safetensors_header import HeaderError, read_header
from rollwire.common.signing import SignatureFile
from rollwire.common.writer import MAX_CHUNK, messages
from rollwire.proxy.config import ProxyConfig
from rollwire.proxy.lineages import Lineages
from rollwire.proxy.publish.fanout import FanOut
from rollwire.proxy.publish.peers import Peers
from rollwire.runtime.logs import get_logger
from rollwire.v1 import generator_pb2 as pb

log = get_logger(__name__)


@dataclass
class Loaded:
    """What a load published: `name` as the caller named it (the core rewrites it for a tenant),
    the lineage's internal name and the version under it, and how far the publication got."""

    name: str
    held: str
    """The name as the fleet holds it (a tenant's qualified), which `name` is until the core rewrites it."""
    lineage: str
    version: int
    sha256: str
    signer: str
    committed: bool
    """Committed on some replica before the answer (else durable in the spool: "spooled")."""
    already_loaded: bool
    replicas: list[pb.ReplicaPushResult] = field(default_factory=list)
    new_lineage: bool = False
    earlier_failure: str = ""
    """A publication of this name answered at "spooled" that no replica then committed."""


class Loads:
    """Loads and unloads by name over the spool's lineages, the fan-out and the peers."""

    def __init__(
        self,
        config: ProxyConfig,
        fanout: FanOut,
        peers: Peers | None,
        admit: Callable[[pb.AdapterManifest], None],
        fleet_model: Callable[[], Awaitable[str]],
    ) -> None:
        self.config, self.fanout, self.peers, self.admit = config, fanout, peers, admit
        """`admit(manifest)`: the core's spool-quota check of the caller's tenant, as for a gRPC push (raises)."""
        self.fleet_model = fleet_model
        """async () -> the fingerprint a load is pushed for (the core's: declared, agreed by the spool, or
        the door's model folder); raises FAILED_PRECONDITION BASE_MODEL_UNKNOWN."""
        self._locks: dict[str, tuple[asyncio.Lock, list[int]]] = {}

    @property
    def lineages(self) -> Lineages:
        return self.fanout.spool.lineages

    # -- reads ------------------------------------------------------------------------------
    def known(self, name: str) -> set[int]:
        """Versions of internal `name` the fleet has: spooled, on a member, or answered."""
        replicas = self.fanout.replicas
        held = {a.version for a in self.fanout.spool.versions(name)}
        for replica in replicas.all():
            held.update(replica.versions.get(name, ()))
        return held | {v for n, v in replicas.answered if n == name}

    def is_hidden(self, name: str, version: int) -> bool:
        """Was this version unloaded (version 0: every version the fleet has of `name`)?"""
        internal = self.lineages.internal(name)
        unloaded = self.lineages.unloaded(internal)
        if version or not unloaded:
            return version in unloaded
        known = self.known(internal)
        return bool(known) and known <= unloaded

    def external(self, name: str, version: int) -> str | None:
        """The name a replica's (internal name, version) is listed under: its external name's,
        or None for an earlier lineage or an unloaded version."""
        external = self.lineages.external(name)
        if external is None or version in self.lineages.unloaded(name):
            return None
        return external

    def newest(self, name: str) -> int:
        spooled = max((a.version for a in self.fanout.spool.versions(name)), default=0)
        return max(spooled, self.fanout.replicas.latest(name))

    # -- unloading --------------------------------------------------------------------------
    async def unload(self, name: str, version: int, asked: str) -> list[int]:
        """Unload `version` of `name` (0: every version of its current lineage) for good:
        durable, and in every synced peer's map, each within `peering.timeout_s`, before it
        answers. NOT_FOUND ADAPTER_NOT_FOUND, in vLLM's words about `asked`, for what the fleet never had."""
        internal = self.lineages.internal(name)
        known = self.known(internal)
        if (version and version not in known) or not known:
            raise NotFound(f"The lora adapter '{asked[:256]}' cannot be found.", reason=Reason.ADAPTER_NOT_FOUND)
        versions = [version] if version else sorted(known)
        self.lineages.prune(lambda n, v: v in self.known(n))
        self.lineages.unload(internal, versions)
        await self.lineages.flush()
        log.info("adapter_unloaded", name=name, internal=internal, versions=versions)
        await self._share_lineages()
        return versions

    # -- loading ----------------------------------------------------------------------------
    async def load(
        self, name: str, version: int, lora: LoraShape, payload: bytes, rid: str, signed: SignatureFile | None = None
    ) -> Loaded:
        """Push `payload` as `version` of `name` (0: its next one; with a signature, the signed
        version) to every replica, under the name's current lineage or, for a new run's v1, a new
        one. The signature rides in the manifest and the spool verifies it (trust.keys_file)."""
        if signed is not None and not version:
            version = signed.version
        if self.lineages.reserved(name):
            raise InvalidArgument(
                f"{name!r} is the internal name of a lineage of another adapter name; load under another name",
                reason=Reason.BAD_ADAPTER_NAME,
            )
        try:
            read_header(payload)
        except HeaderError as exc:  # its text quotes the file's bytes: logged, never echoed (audit A11)
            log.info("adapter_header_refused", lora_name=name[:256], error=str(exc)[:300])
            raise InvalidArgument(
                "adapter_model.safetensors is not a valid safetensors file (its header does not parse; the proxy's "
                "log says why)",
                reason=Reason.BAD_ADAPTER_FOLDER,
            ) from None
        sha256, b3 = await asyncio.to_thread(payload_digests, payload)
        fingerprint = await self.fleet_model()
        async with self._name_lock(name):
            internal = self.lineages.internal(name)
            if not version:
                version = self.newest(internal) + 1
            if version > 1 or not self._restarts(internal, sha256):
                return await self._push(name, internal, version, fingerprint, lora, payload, sha256, rid, signed, b3)
            if signed is not None:
                raise _signed_restart(name)
            internal, generation = self.lineages.next_lineage(name, self._taken)
            loaded = await self._push(name, internal, 1, fingerprint, lora, payload, sha256, rid, b3=b3)
            self.lineages.switch(name, generation, shared=False)  # only once the new lineage's v1 is durable
            await self.lineages.flush()
            await self._share_switch(name, generation, internal)
            loaded.new_lineage = True
            return loaded

    def _taken(self, name: str) -> bool:
        """Has any replica, the spool or a client used `name`?"""
        return bool(self.known(name)) or self.lineages.internal(name) != name

    def _restarts(self, name: str, sha256: str) -> bool:
        """Does a v1 with `sha256` start a new run of internal `name`? Yes once the lineage has
        a version and its v1 is not these bytes (or left the spool: the lineage moved on)."""
        if not self.newest(name):
            return False
        first = self.fanout.spool.get(name, 1)
        return first is None or first.manifest.sha256 != sha256

    async def _push(
        self,
        external: str,
        name: str,
        version: int,
        fingerprint: str,
        lora: LoraShape,
        payload: bytes,
        sha256: str,
        rid: str,
        signed: SignatureFile | None = None,
        b3: str = "",
    ) -> Loaded:
        """`b3`: the payload's BLAKE3, carried beside its sha256 unless the upload is signed."""
        basis, _ = self.fanout.replicas.push_basis(fingerprint)
        manifest = pb.AdapterManifest(
            name=check_name(name),
            version=version,
            base_model_fingerprint=basis,
            lora_config=lora.to_pb(),
            byte_length=len(payload),
            sha256=sha256,
            blake3="" if signed is not None else b3,  # a signature file covers no BLAKE3 (docs/protocol.md, Digests)
        )
        if signed is not None:
            signed.apply(manifest)
        self.admit(manifest)
        earlier = self.fanout.failed_after_answer.pop(name, "")
        reply = await self.fanout.push(
            _aiter(messages(manifest, payload, MAX_CHUNK)), rid, answer=self.config.http.load_answer
        )
        if self.lineages.show(name, version):
            await self.lineages.flush()
            await self._share_lineages()
        return Loaded(
            name=external,
            held=external,
            lineage=name,
            version=version,
            sha256=sha256,
            signer=manifest.signer,
            committed=bool(reply.replicas),
            already_loaded=reply.already_loaded,
            replicas=list(reply.replicas),
            earlier_failure=earlier,
        )

    async def _share_lineages(self) -> None:
        if self.peers is not None:
            await self.peers.share_lineages()

    async def _share_switch(self, name: str, generation: int, internal: str) -> None:
        """Tell the peers `name` means lineage `generation`: at once when its v1's publication
        ended (a load answered at "committed"), else once it has (its v1 is then in their spools)."""
        publication = self.fanout.replicas.publishing.get((internal, 1))
        if self.peers is not None and publication is not None:
            self.peers.share_lineage_after(publication, name, generation)
            return
        self.lineages.release(name, generation)
        await self._share_lineages()

    @contextlib.asynccontextmanager
    async def _name_lock(self, name: str) -> AsyncIterator[None]:
        lock, users = self._locks.setdefault(name, (asyncio.Lock(), [0]))
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if not users[0]:
                self._locks.pop(name, None)


def _signed_restart(name: str) -> FailedPrecondition:
    """A signed v1 with other bytes than NAME's v1 would start a new lineage, published under an
    internal name the signature does not name (docs/security.md)."""
    return FailedPrecondition(
        f"{name}-v1 with other bytes than the v1 {name!r} already has would start a new lineage under another "
        f"internal name, which its signature does not name; load the new run under a new name, signed for it",
        reason=Reason.BAD_SIGNATURE,
    )


async def _aiter(items: Iterable[pb.PushAdapterRequest]) -> AsyncIterator[pb.PushAdapterRequest]:
    for item in items:
        yield item
