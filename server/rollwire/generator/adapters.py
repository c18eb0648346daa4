"""Versioned LoRA adapters on one replica: validation, the version window, leases.

Invariants:
- versions of a name only increase; re-pushing a loaded version with the same digest is an
  idempotent success, anything else at or below the newest version is refused;
- every push is checked in full (length, digest, fingerprint, config, a bounded header,
  tensor names, shapes and dtypes against the base model, every value finite) before the
  engine is touched, so a refused push leaves the replica serving exactly what it served
  before; the proxy runs the same checks (`check_manifest`, `check_payload`) before it
  spools a push, off the event loop and in time linear in the payload;
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
import math
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from rollwire.common.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from rollwire.common.safetensors_header import (
    HeaderError,
    TensorEntry,
    header_length,
    nonfinite_tensor,
    read_entries,
    read_file_header,
)
from rollwire.generator.types import AdapterSelection

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
PEFT_PREFIX = "base_model.model."
ALL_LINEAR = "all-linear"
LORA_DTYPES = {"F32", "F16", "BF16"}


@dataclass(frozen=True)
class LoraShape:
    """The LoRA hyper-parameters that decide tensor shapes and scaling."""

    r: int
    lora_alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool = False


@dataclass(frozen=True)
class Manifest:
    """What a push declares before its bytes arrive."""

    name: str
    version: int
    base_model_fingerprint: str
    lora: LoraShape
    byte_length: int
    sha256: str


MAX_VERSION = 1 << 53
"""Largest adapter version: exact in JSON and in a double, so every tool reads it right."""
DEFAULT_MAX_VERSION_STEP = 1_000_000
"""A version may be at most newest + this (newest = 0 for a new name), so no single push can
use up a name's version range; pushing 2**53 takes 9e9 pushes."""
MAX_LORA_R = 4096
MAX_TARGET_MODULES = 256
MAX_TARGET_MODULE_CHARS = 256
MAX_HEADER_BYTES = 16 << 20
"""Largest safetensors header of a pushed adapter; with known base shapes the bound is
HEADER_SLACK_BYTES + HEADER_BYTES_PER_TENSOR x the number of tensors expected."""
HEADER_BYTES_PER_TENSOR = 1024
HEADER_SLACK_BYTES = 64 << 10
MAX_TENSORS = 1 << 17
"""Most tensors in an adapter whose base shapes are not known (a spool reload)."""
MAX_TENSOR_DIMS = 4


def check_manifest(m: Manifest, *, fingerprint: str | None, max_bytes: int, holder: str = "replica") -> None:
    """Refuse a manifest before any byte is read; each failure has its own sentence.
    `fingerprint=None` skips the base-model check (a spool reload, before any replica is known)."""
    if not isinstance(m.name, str) or not NAME_RE.fullmatch(m.name):
        raise InvalidArgument(
            f"adapter name {str(m.name)[:80]!r} is invalid: use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit",
            reason="BAD_ADAPTER_NAME",
        )
    if m.version < 1:
        raise InvalidArgument("adapter version must be >= 1", reason="BAD_ADAPTER_VERSION")
    if m.version > MAX_VERSION:
        raise InvalidArgument(
            f"adapter version {m.version} is above the largest version, 2**53 ({MAX_VERSION})", reason="VERSION_TOO_FAR"
        )
    if fingerprint is not None and m.base_model_fingerprint != fingerprint:
        raise FailedPrecondition(
            f"adapter {m.name!r} v{m.version} was trained on base model {m.base_model_fingerprint[:80] or '(none given)'}, "
            f"but the base model served here is {fingerprint}; push an adapter of this base model",
            reason="BASE_MODEL_MISMATCH",
        )
    lora = m.lora
    modules = lora.target_modules
    if (
        not 1 <= lora.r <= MAX_LORA_R
        or not math.isfinite(lora.lora_alpha)
        or not lora.lora_alpha > 0
        or not 1 <= len(modules) <= MAX_TARGET_MODULES
        or not all(1 <= len(t) <= MAX_TARGET_MODULE_CHARS for t in modules)
    ):
        raise InvalidArgument(
            f"lora_config needs 1 <= r <= {MAX_LORA_R}, a finite lora_alpha > 0 and 1 to {MAX_TARGET_MODULES} target "
            f"modules of 1 to {MAX_TARGET_MODULE_CHARS} characters (got r={lora.r}, lora_alpha={lora.lora_alpha}, "
            f"{len(modules)} target modules)",
            reason="BAD_LORA_CONFIG",
        )
    if not re.fullmatch(r"[0-9a-f]{64}", m.sha256):
        raise InvalidArgument("sha256 must be 64 lowercase hex digits", reason="BAD_DIGEST")
    if m.byte_length < 1:
        raise InvalidArgument("byte_length must be > 0", reason="BAD_LENGTH")
    if m.byte_length > max_bytes:
        raise ResourceExhausted(
            f"adapter of {m.byte_length} bytes exceeds this {holder}'s limit of {max_bytes} bytes",
            reason="ADAPTER_TOO_LARGE",
        )


def check_push_version(
    m, newest: int, held_sha256: str | None, holder: str, max_step: int = DEFAULT_MAX_VERSION_STEP
) -> bool:
    """The version rule shared by replicas and the proxy's spool: True when this exact
    version is already held (an idempotent re-push); raises when it may not be pushed.
    `m` is a Manifest or the wire AdapterManifest: only name, version and sha256 are read.
    A version above 2**53 or more than `max_step` above the newest (0 for a new name) is
    refused, so no push can use up the range of a name."""
    if m.version > MAX_VERSION or m.version > newest + max_step:
        raise InvalidArgument(
            f"adapter {m.name!r} v{m.version} is too far ahead: a version may be at most {max_step} above the newest "
            f"(v{newest} on this {holder}) and at most 2**53; push v{newest + 1}",
            reason="VERSION_TOO_FAR",
        )
    if held_sha256 is not None:
        if held_sha256 == m.sha256:
            return True
        raise FailedPrecondition(
            f"adapter {m.name!r} v{m.version} is already loaded with a different digest; "
            f"versions are immutable, push it as v{newest + 1}",
            reason="VERSION_CONFLICT",
        )
    if m.version <= newest:
        raise FailedPrecondition(
            f"adapter {m.name!r} v{m.version} is not above the newest version v{newest} this {holder} has "
            f"accepted; versions only increase, push v{newest + 1} or higher",
            reason="VERSION_NOT_MONOTONIC",
        )
    return False


def check_payload(m: Manifest, payload: bytes, base_shapes: dict[str, tuple[int, int]] | None) -> None:
    """The one payload check of replicas and the proxy: length, digest, a bounded header,
    every tensor's name, shape and dtype against the base model, and every value finite.

    Linear in the payload with capped header work; run it off the event loop
    (`check_payload_async`). `base_shapes=None` (a spool reload) checks the tensors against
    the LoRA config alone. Raises InvalidArgument with a sentence and a reason."""
    if len(payload) != m.byte_length:
        raise InvalidArgument(
            f"upload ended after {len(payload)} of the {m.byte_length} bytes the manifest declared; "
            "the upload was truncated or the manifest is wrong",
            reason="LENGTH_MISMATCH",
        )
    digest = hashlib.sha256(payload).hexdigest()
    if digest != m.sha256:
        raise InvalidArgument(
            f"payload sha256 is {digest} but the manifest declared {m.sha256}; the bytes were corrupted or the manifest is stale",
            reason="DIGEST_MISMATCH",
        )
    if base_shapes is not None:
        expected = expected_lora_shapes(m.lora, base_shapes)
        if not expected:
            raise InvalidArgument(
                f"target_modules {list(m.lora.target_modules)[:8]} match no linear layer of the base model",
                reason="BAD_LORA_CONFIG",
            )
        limits = dict(
            max_header=min(MAX_HEADER_BYTES, HEADER_SLACK_BYTES + HEADER_BYTES_PER_TENSOR * len(expected)),
            max_tensors=len(expected),
        )
    else:
        expected, limits = None, dict(max_header=MAX_HEADER_BYTES, max_tensors=MAX_TENSORS)
    try:
        tensors = read_entries(payload, max_dims=MAX_TENSOR_DIMS, **limits)
    except HeaderError as exc:
        raise InvalidArgument(f"payload is not a safetensors adapter: {exc}", reason="BAD_PAYLOAD") from None
    if expected is None:
        _check_lora_tensors(m.lora, tensors)
    else:
        _check_expected_tensors(m.lora, tensors, expected)
    bad = nonfinite_tensor(payload, tensors, 8 + header_length(payload))
    if bad is not None:
        raise InvalidArgument(
            f"tensor {bad} holds NaN or infinite values; a diverged adapter is never served, push finite weights",
            reason="NON_FINITE_WEIGHTS",
        )


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
            reason="TENSOR_MISMATCH",
        )
    for name, shape in expected.items():
        e = tensors[name]
        if e.shape != shape or e.dtype not in LORA_DTYPES:
            raise InvalidArgument(
                f"tensor {name} has shape {list(e.shape)} ({e.dtype}); the base model and r={lora.r} "
                f"need {list(shape)} in F32, F16 or BF16",
                reason="TENSOR_MISMATCH",
            )


def _check_lora_tensors(lora: LoraShape, tensors: dict[str, TensorEntry]) -> None:
    """Without the base model: PEFT names, 2-D LoRA shapes of rank r, float dtypes."""
    if not tensors:
        raise InvalidArgument("the adapter holds no tensors", reason="TENSOR_MISMATCH")
    for name, e in tensors.items():
        kind = "A" if name.endswith(".lora_A.weight") else "B" if name.endswith(".lora_B.weight") else ""
        rank_ok = len(e.shape) == 2 and e.shape[0 if kind == "A" else 1] == lora.r
        if not name.startswith(PEFT_PREFIX) or not kind or not rank_ok or e.dtype not in LORA_DTYPES:
            raise InvalidArgument(
                f"tensor {name[:120]} ({e.dtype}, shape {list(e.shape)}) is not a LoRA weight of rank r={lora.r} in "
                "F32, F16 or BF16",
                reason="TENSOR_MISMATCH",
            )


def manifest_from_pb(m) -> Manifest:
    """The wire AdapterManifest as a Manifest (the digest as sent: only lowercase hex is valid)."""
    lora = LoraShape(
        r=m.lora_config.r,
        lora_alpha=m.lora_config.lora_alpha,
        target_modules=tuple(m.lora_config.target_modules),
        use_rslora=m.lora_config.use_rslora,
    )
    return Manifest(m.name, m.version, m.base_model_fingerprint, lora, m.byte_length, m.sha256)


async def idle_bounded(messages, idle_s: float, holder: str):
    """The messages of a push stream; DEADLINE_EXCEEDED when none arrives for `idle_s`, so a
    stalled sender cannot hold an upload slot (and its buffered bytes) until its deadline."""
    it = aiter(messages)
    while True:
        try:
            msg = await asyncio.wait_for(anext(it), idle_s)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise DeadlineExceeded(
                f"the push sent no message for {idle_s:g} s, so this {holder} cancelled it; send the chunks without "
                "pausing and push again",
                reason="PUSH_IDLE",
            ) from None
        yield msg


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


class AdapterRegistry:
    """The replica's book of adapter versions; the engine holds the weights.

    `load(handle, manifest, payload)` and `unload(handle)` are the engine's calls. All
    bookkeeping runs on the event loop; a per-replica lock serialises pushes.
    """

    def __init__(
        self,
        load: Callable[[str, Manifest, bytes], Awaitable[None]],
        unload: Callable[[str], Awaitable[None]],
        window: int,
    ) -> None:
        self._load, self._unload, self.window = load, unload, window
        self._versions: dict[str, list[_Version]] = {}
        self._newest: dict[str, int] = {}
        self._lock = asyncio.Lock()
        self._counter = 0
        self._pending_unloads: set[asyncio.Task] = set()

    def check_version(self, m: Manifest, max_step: int = DEFAULT_MAX_VERSION_STEP) -> bool:
        """True if this exact version is loaded (idempotent); raises if it may not be pushed."""
        same = next((v for v in self._versions.get(m.name, []) if v.version == m.version and v.servable), None)
        return check_push_version(m, self._newest.get(m.name, 0), same.sha256 if same else None, "replica", max_step)

    async def push(self, m: Manifest, payload: bytes, max_step: int = DEFAULT_MAX_VERSION_STEP) -> PushOutcome:
        """Load a checked payload as a new version and retire what leaves the window."""
        async with self._lock:
            if self.check_version(m, max_step):
                return PushOutcome(m.name, m.version, True, self.loaded().get(m.name, []))
            self._counter += 1
            handle = f"rw{self._counter}"
            await self._load(handle, m, payload)
            versions = self._versions.setdefault(m.name, [])
            versions.append(_Version(m.version, m.sha256, handle))
            self._newest[m.name] = m.version
            servable = [v for v in versions if v.servable]
            for old in servable[: max(0, len(servable) - self.window)]:
                old.servable = False
                self._maybe_unload(m.name, old)
            return PushOutcome(m.name, m.version, False, self.loaded().get(m.name, []))

    def acquire(self, name: str, version: int) -> AdapterSelection:
        """Resolve a request's adapter (version 0 = newest) and hold it until release."""
        if not name:
            return AdapterSelection()
        versions = [v for v in self._versions.get(name, []) if v.servable]
        if not versions:
            known = ", ".join(sorted(self.loaded())) or "none"
            raise NotFound(
                f"no adapter named {name!r} is loaded on this replica (loaded: {known}); push it first",
                reason="ADAPTER_NOT_FOUND",
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
                        reason="ADAPTER_VERSION_EVICTED",
                    )
                raise NotFound(
                    f"adapter {name!r} v{version} is not loaded on this replica (loaded: {loaded}); "
                    "it has not been pushed here yet",
                    reason="ADAPTER_VERSION_NOT_FOUND",
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

    def loaded(self) -> dict[str, list[int]]:
        """Servable versions per name, oldest first."""
        out = {}
        for name, versions in self._versions.items():
            servable = [v.version for v in versions if v.servable]
            if servable:
                out[name] = servable
        return out

    def _maybe_unload(self, name: str, v: _Version) -> None:
        if v.servable or v.leases > 0:
            return
        self._versions[name].remove(v)
        task = asyncio.get_running_loop().create_task(self._unload(v.handle))
        self._pending_unloads.add(task)
        task.add_done_callback(self._pending_unloads.discard)

    async def settle(self) -> None:
        """Wait for pending unloads (tests and shutdown)."""
        while self._pending_unloads:
            await asyncio.gather(*list(self._pending_unloads), return_exceptions=True)
