"""Versioned LoRA adapters on one replica: validation, the version window, leases.

Invariants:
- versions of a name only increase; re-pushing a loaded version with the same digest is an
  idempotent success, anything else at or below the newest version is refused;
- every push is checked in full (length, digest, fingerprint, config, a bounded header,
  tensor names, shapes and dtypes against the base model, every value finite) before the
  engine is touched, so a refused push leaves the replica serving exactly what it served
  before; replicas and the proxy run the same checks (push.check_manifest, then
  `PayloadInspector` and the digest while the bytes arrive; `check_payload` on bytes at
  rest), off the event loop and in time linear in the payload;
- a version staged by a `stage_only` push is loaded but never servable until committed
  with its digest, and is dropped when not committed within `stage_timeout_s`;
- versions are at most 2**53 and at most `max_version_step` above the newest;
- the K newest versions of each name are servable; an older version stops being servable
  at once and is unloaded from the engine when its last request finishes (leases);
- engine handles are never reused, so no cache entry of an old policy can be served under
  a new version.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from rollwire.common.errors import FailedPrecondition, InvalidArgument, NotFound, RollwireError
from rollwire.common.lora import LoraShape
from rollwire.common.push import (  # noqa: F401 (the manifest rules live in the push protocol; re-exported)
    DEFAULT_MAX_VERSION_STEP,
    MAX_LORA_R,
    MAX_VERSION,
    NAME_RE,
    Manifest,
    check_manifest,
    check_push_version,
    idle_bounded,
    manifest_from_pb,
)
from rollwire.common.reasons import Reason
from rollwire.common.safetensors_header import (
    HeaderError,
    StreamingFinite,
    TensorEntry,
    header_length,
    nonfinite_tensor,
    read_entries,
    read_file_header,
)
from rollwire.generator.types import AdapterSelection

PEFT_PREFIX = "base_model.model."
ALL_LINEAR = "all-linear"
LORA_DTYPES = {"F32", "F16", "BF16"}
MAX_HEADER_BYTES = 16 << 20
"""Largest safetensors header of a pushed adapter; with known base shapes the bound is
HEADER_SLACK_BYTES + HEADER_BYTES_PER_TENSOR x the number of tensors expected."""
HEADER_BYTES_PER_TENSOR = 1024
HEADER_SLACK_BYTES = 64 << 10
MAX_TENSORS = 1 << 17
"""Most tensors in an adapter whose base shapes are not known (a spool reload)."""
MAX_TENSOR_DIMS = 4
DEFAULT_STAGE_TIMEOUT_S = 300.0
"""A staged version not committed within this long is dropped (limits.stage_timeout_s)."""


def check_payload(m: Manifest, payload: bytes, base_shapes: dict[str, tuple[int, int]] | None) -> None:
    """The whole check of bytes that were not hashed while they arrived (a spool reload, a
    test): length, digest, then `check_tensors`. Raises InvalidArgument with a reason."""
    if len(payload) != m.byte_length:
        raise InvalidArgument(
            f"upload ended after {len(payload)} of the {m.byte_length} bytes the manifest declared; "
            "the upload was truncated or the manifest is wrong",
            reason=Reason.LENGTH_MISMATCH,
        )
    digest = hashlib.sha256(payload).hexdigest()
    if digest != m.sha256:
        raise InvalidArgument(
            f"payload sha256 is {digest} but the manifest declared {m.sha256}; the bytes were corrupted or the manifest is stale",
            reason=Reason.DIGEST_MISMATCH,
        )
    check_tensors(m, payload, base_shapes)


def check_header(m: Manifest, data: bytes, base_shapes: dict[str, tuple[int, int]] | None) -> dict[str, TensorEntry]:
    """The safetensors header of a payload of `m.byte_length` bytes, from `data` (the whole
    payload or only a prefix holding the header): a bounded header, then every tensor's
    name, shape and dtype against the base model (or, with `base_shapes=None`, against the
    LoRA config alone). Raises InvalidArgument (BAD_PAYLOAD, TENSOR_MISMATCH, BAD_LORA_CONFIG)."""
    if base_shapes is not None:
        expected = expected_lora_shapes(m.lora, base_shapes)
        if not expected:
            raise InvalidArgument(
                f"target_modules {list(m.lora.target_modules)[:8]} match no linear layer of the base model",
                reason=Reason.BAD_LORA_CONFIG,
            )
        limits = dict(
            max_header=min(MAX_HEADER_BYTES, HEADER_SLACK_BYTES + HEADER_BYTES_PER_TENSOR * len(expected)),
            max_tensors=len(expected),
        )
    else:
        expected, limits = None, dict(max_header=MAX_HEADER_BYTES, max_tensors=MAX_TENSORS)
    try:
        body = m.byte_length - 8 - header_length(data)
        tensors = read_entries(data, body, max_dims=MAX_TENSOR_DIMS, **limits)
    except HeaderError as exc:
        raise InvalidArgument(f"payload is not a safetensors adapter: {exc}", reason=Reason.BAD_PAYLOAD) from None
    if expected is None:
        _check_lora_tensors(m.lora, tensors)
    else:
        _check_expected_tensors(m.lora, tensors, expected)
    return tensors


def header_bytes_needed(data: bytes) -> int | None:
    """How many leading bytes of a payload hold its whole header; None before 8 bytes."""
    return None if len(data) < 8 else 8 + header_length(data)


def check_tensors(m: Manifest, payload: bytes, base_shapes: dict[str, tuple[int, int]] | None) -> None:
    """The payload check that follows an incremental digest (push.PushReader): the header
    (`check_header`), then every value finite. Linear in the payload with capped header work;
    run it off the event loop (`check_tensors_async`)."""
    tensors = check_header(m, payload, base_shapes)
    bad = nonfinite_tensor(payload, tensors, 8 + header_length(payload))
    if bad is not None:
        raise InvalidArgument(
            f"tensor {bad} holds NaN or infinite values; a diverged adapter is never served, push finite weights",
            reason=Reason.NON_FINITE_WEIGHTS,
        )


class PayloadInspector:
    """`check_tensors` while the payload arrives: push.PushReader feeds it every chunk, in
    order, on its worker thread. The header is checked as soon as it is complete (a bad one
    is refused before the rest arrives) and every float value once, as it passes, so when
    the stream ends only its last piece is left to look at. The same checks, sentences and
    reasons as `check_tensors`; `error` holds the first failure."""

    def __init__(self, m: Manifest, base_shapes: dict[str, tuple[int, int]] | None) -> None:
        self.manifest, self.base_shapes = m, base_shapes
        self.prefix: bytearray | None = bytearray()
        self.scanner: StreamingFinite | None = None
        self.error: RollwireError | None = None

    def feed(self, chunk: bytes) -> None:
        if self.error is not None:
            return
        try:
            if self.scanner is None:
                assert self.prefix is not None
                self.prefix += chunk
                if not self._header_ready():
                    return
                body_offset = 8 + header_length(self.prefix)
                tensors = check_header(self.manifest, bytes(self.prefix[:body_offset]), self.base_shapes)
                self.scanner = StreamingFinite(tensors, body_offset)
                chunk, self.prefix = bytes(self.prefix), None
            bad = self.scanner.feed(chunk)
            if bad is not None:
                raise InvalidArgument(
                    f"tensor {bad} holds NaN or infinite values; a diverged adapter is never served, push finite weights",
                    reason=Reason.NON_FINITE_WEIGHTS,
                )
        except InvalidArgument as exc:
            self.error = exc

    def _header_ready(self) -> bool:
        """Enough bytes to judge the header: all of it, or enough to know it is too large."""
        assert self.prefix is not None
        if len(self.prefix) < 8:
            return False
        need = 8 + header_length(self.prefix)
        return len(self.prefix) >= need or need > min(self.manifest.byte_length, 8 + MAX_HEADER_BYTES)

    def finish(self, payload: bytes | list[bytes]) -> None:
        """After the last chunk, with the payload (or its chunks): raises the first failure;
        checks what could not be checked in pieces (a payload too short for its header,
        overlapping tensors: only hostile payloads, so joining chunks there costs nothing real)."""
        if self.error is None and (self.scanner is None or self.scanner.needs_full_scan):
            whole = payload if isinstance(payload, bytes) else b"".join(payload)
            tensors = check_header(self.manifest, whole, self.base_shapes)  # raises if the header never completed
            bad = nonfinite_tensor(whole, tensors, 8 + header_length(whole))
            if bad is not None:
                self.error = InvalidArgument(
                    f"tensor {bad} holds NaN or infinite values; a diverged adapter is never served, push finite weights",
                    reason=Reason.NON_FINITE_WEIGHTS,
                )
        if self.error is not None:
            raise self.error


async def check_tensors_async(m: Manifest, payload: bytes, base_shapes: dict[str, tuple[int, int]] | None) -> None:
    """`check_tensors` in a worker thread (the finiteness scan works in blocks)."""
    await asyncio.to_thread(check_tensors, m, payload, base_shapes)


async def check_payload_async(m: Manifest, payload: bytes, base_shapes: dict[str, tuple[int, int]] | None) -> None:
    """`check_payload` in a worker thread: hashing releases the GIL, the rest works in blocks."""
    await asyncio.to_thread(check_payload, m, payload, base_shapes)


def _check_expected_tensors(
    lora: LoraShape, tensors: dict[str, TensorEntry], expected: dict[str, tuple[int, int]]
) -> None:
    unexpected = sorted(set(tensors) - set(expected))
    missing = sorted(set(expected) - set(tensors))
    if unexpected or missing:
        raise InvalidArgument(
            f"adapter tensors do not match the base model and lora_config: "
            f"{len(missing)} missing (e.g. {missing[:2]}), {len(unexpected)} unexpected (e.g. {[u[:120] for u in unexpected[:2]]})",
            reason=Reason.TENSOR_MISMATCH,
        )
    for name, shape in expected.items():
        e = tensors[name]
        if e.shape != shape or e.dtype not in LORA_DTYPES:
            raise InvalidArgument(
                f"tensor {name} has shape {list(e.shape)} ({e.dtype}); the base model and r={lora.r} "
                f"need {list(shape)} in F32, F16 or BF16",
                reason=Reason.TENSOR_MISMATCH,
            )


def _check_lora_tensors(lora: LoraShape, tensors: dict[str, TensorEntry]) -> None:
    """Without the base model: PEFT names, 2-D LoRA shapes of rank r, float dtypes."""
    if not tensors:
        raise InvalidArgument("the adapter holds no tensors", reason=Reason.TENSOR_MISMATCH)
    for name, e in tensors.items():
        kind = "A" if name.endswith(".lora_A.weight") else "B" if name.endswith(".lora_B.weight") else ""
        rank_ok = len(e.shape) == 2 and e.shape[0 if kind == "A" else 1] == lora.r
        if not name.startswith(PEFT_PREFIX) or not kind or not rank_ok or e.dtype not in LORA_DTYPES:
            raise InvalidArgument(
                f"tensor {name[:120]} ({e.dtype}, shape {list(e.shape)}) is not a LoRA weight of rank r={lora.r} in "
                "F32, F16 or BF16",
                reason=Reason.TENSOR_MISMATCH,
            )


def expected_lora_shapes(lora: LoraShape, base_shapes: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """PEFT state-dict key -> shape for every base linear layer the config targets."""
    shapes: dict[str, tuple[int, int]] = {}
    for module, (out_f, in_f) in base_shapes.items():
        if targets(module, lora.target_modules):
            shapes[f"{PEFT_PREFIX}{module}.lora_A.weight"] = (lora.r, in_f)
            shapes[f"{PEFT_PREFIX}{module}.lora_B.weight"] = (out_f, lora.r)
    return shapes


def targets(module: str, target_modules: tuple[str, ...]) -> bool:
    """PEFT's list matching: the module name equals a target or ends with '.' + target."""
    if ALL_LINEAR in target_modules:
        return True
    return any(module == t or module.endswith("." + t) for t in target_modules)


def base_linear_shapes(model_dir: str | Path, *, config_only: bool = False) -> dict[str, tuple[int, int]]:
    """Module name -> (out, in) of every linear layer LoRA may target, from weight headers.

    Embeddings and the output head are excluded, as PEFT's "all-linear" excludes them.
    With `config_only` (the scripted benchmark engine) a folder without weights gets the
    shapes a Llama/Qwen2-family config.json implies.
    """
    weights = sorted(Path(model_dir).glob("*.safetensors"))
    if not weights and config_only:
        return config_linear_shapes(json.loads(Path(model_dir, "config.json").read_text()))
    shapes: dict[str, tuple[int, int]] = {}
    for path in weights:
        for name, (_, shape) in read_file_header(path).items():
            if not name.endswith(".weight") or len(shape) != 2:
                continue
            module = name[: -len(".weight")]
            if "embed" in module or module.endswith("lm_head"):
                continue
            shapes[module] = (shape[0], shape[1])
    return shapes


CONFIG_SHAPE_FAMILIES = ("llama", "qwen2", "mistral")


def config_linear_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """The linear layers of a Llama/Qwen2-family decoder, from its config.json values."""
    if config.get("model_type") not in CONFIG_SHAPE_FAMILIES:
        raise ValueError(
            f"cannot derive layer shapes of model_type {config.get('model_type')!r} from config.json "
            f"(known: {', '.join(CONFIG_SHAPE_FAMILIES)}); give the folder its *.safetensors weights"
        )
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    layer = {
        "self_attn.q_proj": (heads * head_dim, hidden),
        "self_attn.k_proj": (kv_heads * head_dim, hidden),
        "self_attn.v_proj": (kv_heads * head_dim, hidden),
        "self_attn.o_proj": (hidden, heads * head_dim),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }
    return {
        f"model.layers.{i}.{module}": shape
        for i in range(config["num_hidden_layers"])
        for module, shape in layer.items()
    }


@dataclass
class _Version:
    version: int
    sha256: str
    handle: str
    leases: int = 0
    servable: bool = True


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
    sha256: str
    handle: str
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
        load: Callable[[str, Manifest, bytes], Awaitable[None]],
        unload: Callable[[str], Awaitable[None]],
        window: int,
        stage_timeout_s: float = DEFAULT_STAGE_TIMEOUT_S,
    ) -> None:
        self._load, self._unload, self.window = load, unload, window
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
        return check_push_version(m, self._newest.get(m.name, 0), same.sha256 if same else None, "replica", max_step)

    async def push(self, m: Manifest, payload: bytes, max_step: int = DEFAULT_MAX_VERSION_STEP) -> PushOutcome:
        """Load a checked payload as a new version and retire what leaves the window (a
        version staged with the same digest is committed without loading it again)."""
        async with self._lock:
            if self.check_version(m, max_step):
                return PushOutcome(m.name, m.version, True, self.loaded().get(m.name, []))
            staged = self._staged.get(m.name)
            if staged is not None and (staged.version, staged.sha256) == (m.version, m.sha256):
                return self._make_servable(m.name, self._unstage(m.name))
            handle = await self._load_new(m, payload)
            return self._make_servable(m.name, _Staged(m.version, m.sha256, handle))

    async def stage(self, m: Manifest, payload: bytes, max_step: int = DEFAULT_MAX_VERSION_STEP) -> PushOutcome:
        """Load a checked payload without serving it; `commit` serves it. Staging the staged
        version again only restarts its timer; a version already served is an idempotent
        success (`already_loaded`, not staged)."""
        async with self._lock:
            if self.check_version(m, max_step):
                return PushOutcome(m.name, m.version, True, self.loaded().get(m.name, []))
            staged = self._staged.get(m.name)
            if staged is None or (staged.version, staged.sha256) != (m.version, m.sha256):
                handle = await self._load_new(m, payload)
                self._drop_staged(m.name)
                staged = self._staged[m.name] = _Staged(m.version, m.sha256, handle)
            if staged.expiry is not None:
                staged.expiry.cancel()
            staged.expiry = asyncio.get_running_loop().call_later(
                self.stage_timeout_s, self._expire, m.name, staged.handle
            )
            return PushOutcome(m.name, m.version, False, self.loaded().get(m.name, []), staged=True)

    async def commit(self, name: str, version: int, sha256: str) -> PushOutcome:
        """Serve the staged `version` of `name`; idempotent once served with that digest.
        FAILED_PRECONDITION when it is not staged with this digest (never staged, replaced,
        expired, or this replica restarted) or is no longer above the newest version."""
        async with self._lock:
            held = next((v for v in self._versions.get(name, []) if v.version == version and v.servable), None)
            if held is not None and held.sha256 == sha256:
                return PushOutcome(name, version, True, self.loaded().get(name, []))
            staged = self._staged.get(name)
            if staged is None or (staged.version, staged.sha256) != (version, sha256):
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
            return self._make_servable(name, self._unstage(name))

    def staged(self) -> dict[str, int]:
        """The staged (not servable) version of each name."""
        return {name: s.version for name, s in self._staged.items()}

    async def _load_new(self, m: Manifest, payload: bytes) -> str:
        self._counter += 1
        handle = f"rw{self._counter}"
        await self._load(handle, m, payload)
        return handle

    def _make_servable(self, name: str, item: _Staged) -> PushOutcome:
        versions = self._versions.setdefault(name, [])
        versions.append(_Version(item.version, item.sha256, item.handle))
        self._newest[name] = item.version
        servable = [v for v in versions if v.servable]
        for old in servable[: max(0, len(servable) - self.window)]:
            old.servable = False
            self._maybe_unload(name, old)
        staged = self._staged.get(name)
        if staged is not None and staged.version <= item.version:
            self._drop_staged(name)  # it can never be committed now: versions only increase
        for listener in self.on_servable:
            listener(name, item.version)
        return PushOutcome(name, item.version, False, self.loaded().get(name, []))

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

    def acquire(self, name: str, version: int) -> AdapterSelection:
        """Resolve a request's adapter (version 0 = newest) and hold it until release."""
        if not name:
            return AdapterSelection()
        versions = [v for v in self._versions.get(name, []) if v.servable]
        if not versions:
            known = ", ".join(sorted(self.loaded())) or "none"
            raise NotFound(
                f"no adapter named {name!r} is loaded on this replica (loaded: {known}); push it first",
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
                        f"adapter {name!r} v{version} has left this replica's window of the {self.window} newest "
                        f"versions (loaded: {loaded}); request a loaded version or the latest",
                        reason=Reason.ADAPTER_VERSION_EVICTED,
                    )
                raise NotFound(
                    f"adapter {name!r} v{version} is not loaded on this replica (loaded: {loaded}); "
                    "it has not been pushed here yet",
                    reason=Reason.ADAPTER_VERSION_NOT_FOUND,
                )
        chosen.leases += 1
        return AdapterSelection(name, chosen.version, chosen.handle)

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

    def _maybe_unload(self, name: str, v: _Version) -> None:
        if v.servable or v.leases > 0:
            return
        self._versions[name].remove(v)
        self._unload_later(v.handle)

    async def settle(self) -> None:
        """Wait for pending unloads (tests and shutdown)."""
        while self._pending_unloads:
            await asyncio.gather(*list(self._pending_unloads), return_exceptions=True)
