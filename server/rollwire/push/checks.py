"""Payload checks of a pushed adapter: header, tensor names, shapes, dtypes, finiteness.

Replicas and the proxy run the same checks, with the same sentences and reasons: while the
bytes arrive (`PayloadInspector`, fed by the push's sink after the manifest passed
`rollwire.common.manifest.check_manifest`), or on bytes at rest (`check_payload`: a spool
reload, a test).

Invariants:
- the safetensors header is bounded before it is parsed: with known base shapes by
  HEADER_SLACK_BYTES + HEADER_BYTES_PER_TENSOR x `expected_tensor_bound` (twice the tensors
  expected, plus 64), else MAX_HEADER_BYTES and MAX_TENSORS; a bad header is refused before the
  rest of the payload arrives;
- with the base model's LoRA layers (`rollwire.generator.shapes`: nn.Linear and Conv1D, from the
  model's own modules), the tensors are exactly PEFT's LoRA tensors of the layers
  `target_modules` matches, of rank r, in F32, F16 or BF16; what PEFT writes that no such layer
  takes (modules_to_save, MoE experts and routers) is refused by name (`unservable`); without
  them (a spool reload), every tensor is a PEFT LoRA weight of rank r;
- every float value is finite; a diverged adapter is never served;
- the work is linear in the payload with capped header work, and runs off the event loop.
"""

from __future__ import annotations

import asyncio
import hashlib

from blake3 import blake3

from rollwire.common.errors import InvalidArgument, RollwireError
from rollwire.common.lora import LoraShape
from rollwire.common.manifest import Manifest
from rollwire.common.reasons import Reason
from rollwire.common.safetensors_header import (
    HeaderError,
    StreamingFinite,
    TensorEntry,
    header_length,
    nonfinite_tensor,
    read_entries,
)
from rollwire.push.buffers import Payload, as_bytes

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


def check_payload(m: Manifest, payload: bytes, base_shapes: dict[str, tuple[int, int]] | None) -> None:
    """The whole check of bytes that were not hashed while they arrived (a spool reload, a
    test): length, digest, then `check_tensors`. Raises InvalidArgument with a reason."""
    if len(payload) != m.byte_length:
        raise InvalidArgument(
            f"upload ended after {len(payload)} of the {m.byte_length} bytes the manifest declared; "
            "the upload was truncated or the manifest is wrong",
            reason=Reason.LENGTH_MISMATCH,
        )
    for name, want, digest in (("sha256", m.sha256, hashlib.sha256), ("blake3", m.blake3, blake3)):
        got = digest(payload).hexdigest() if want else want  # at rest: both, when the manifest has both
        if got != want:
            raise InvalidArgument(
                f"payload {name} is {got} but the manifest declared {want}; the bytes were corrupted or the manifest "
                "is stale",
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
        bound = expected_tensor_bound(len(expected))
        limits = dict(
            max_header=min(MAX_HEADER_BYTES, HEADER_SLACK_BYTES + HEADER_BYTES_PER_TENSOR * bound),
            max_tensors=bound,
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


def check_tensors(m: Manifest, payload: bytes, base_shapes: dict[str, tuple[int, int]] | None) -> None:
    """The payload check that follows an incremental digest (push.reader.PushReader): the header
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
    """`check_tensors` while the payload arrives: the push's reader feeds it every chunk, in
    order, on its worker thread. The header is checked as soon as it is complete (a bad one
    is refused before the rest arrives) and every float value once, as it passes, so when
    the stream ends only its last piece is left to look at. The same checks, sentences and
    reasons as `check_tensors`; `error` holds the first failure."""

    def __init__(self, m: Manifest, base_shapes: dict[str, tuple[int, int]] | None) -> None:
        self.manifest, self.base_shapes = m, base_shapes
        self.prefix: bytearray | None = bytearray()
        self.scanner: StreamingFinite | None = None
        self.error: RollwireError | None = None

    def feed(self, chunk: bytes | memoryview) -> None:
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

    @property
    def header_passed(self) -> bool:
        """The header was complete and passed `check_header` (checked once, when it completed):
        what `proxy.publish.header_gate.HeaderGate` waits for before anything is forwarded."""
        return self.scanner is not None

    def _header_ready(self) -> bool:
        """Enough bytes to judge the header: all of it, or enough to know it is too large."""
        assert self.prefix is not None
        if len(self.prefix) < 8:
            return False
        need = 8 + header_length(self.prefix)
        return len(self.prefix) >= need or need > min(self.manifest.byte_length, 8 + MAX_HEADER_BYTES)

    def finish(self, payload: Payload | list[bytes]) -> None:
        """After the last chunk, with the payload (or its chunks): raises the first failure;
        checks what could not be checked in pieces (a payload too short for its header,
        overlapping tensors: only hostile payloads, so joining chunks there costs nothing real)."""
        if self.error is None and (self.scanner is None or self.scanner.needs_full_scan):
            whole = b"".join(payload) if isinstance(payload, list) else as_bytes(payload)
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


def expected_tensor_bound(expected: int) -> int:
    """Most tensors a header may list when `expected` are expected: room for what PEFT adds
    beside them (experts, routers, modules_to_save), so a refusal can name those tensors rather
    than count them; still linear in what the base model allows."""
    return 2 * expected + 64


def unservable(name: str) -> str | None:
    """Why a tensor PEFT may write is not a LoRA weight of a layer this base model serves, in
    words a user can act on; None for a plain LoRA A/B name (then its module is what is wrong)."""
    module = name.removeprefix(PEFT_PREFIX)
    if ".lora_magnitude_vector" in module:
        return (
            f"tensor {name[:120]} is a DoRA magnitude vector (use_dora=True); rollwire serves plain LoRA: train "
            "with use_dora=False"
        )
    if module.endswith(".lora_B.bias") or module.endswith(".lora_A.bias"):
        return (
            f"tensor {name[:120]} is a LoRA bias (lora_bias=True); rollwire serves LoRA without bias: train without it"
        )
    if ".modules_to_save." in module or not module.endswith((".lora_A.weight", ".lora_B.weight")):
        whole = module.split(".modules_to_save.")[0].removesuffix(".weight").removesuffix(".bias")
        return (
            f"tensor {name[:120]} is a whole module's weights ({whole[:80]}), as PEFT's modules_to_save (or "
            "trainable_token_indices) writes them, not a LoRA weight; rollwire serves LoRA A/B weights only: "
            "train without modules_to_save"
        )
    layer = module.rsplit(".lora_", 1)[0]
    if ".experts" in layer:
        return (
            f"tensor {name[:120]} is a LoRA of a MoE model's expert weights ({layer[:80]}: PEFT's "
            "target_parameters, which 'all-linear' adds on MoE models even with target_parameters=[]); rollwire "
            "does not serve LoRA on experts yet: list the layers in target_modules instead of 'all-linear' "
            "(e.g. q_proj, k_proj, v_proj, o_proj)"
        )
    if layer.endswith((".gate", ".router")):
        return (
            f"tensor {name[:120]} is a LoRA of a MoE router ({layer[:80]}: PEFT's target_parameters, which "
            "'all-linear' adds on MoE models), not of a linear layer; rollwire does not serve LoRA on routers: "
            "list the layers in target_modules instead of 'all-linear' (e.g. q_proj, k_proj, v_proj, o_proj)"
        )
    return None


def _check_expected_tensors(
    lora: LoraShape, tensors: dict[str, TensorEntry], expected: dict[str, tuple[int, int]]
) -> None:
    unexpected = sorted(set(tensors) - set(expected))
    missing = sorted(set(expected) - set(tensors))
    why = next((w for w in map(unservable, unexpected) if w is not None), None)
    if why is not None:
        raise InvalidArgument(why, reason=Reason.TENSOR_MISMATCH)
    if unexpected or missing:
        raise InvalidArgument(
            f"adapter tensors do not match the base model and lora_config: "
            f"{len(missing)} missing (e.g. {missing[:2]}), {len(unexpected)} unexpected (e.g. {[u[:120] for u in unexpected[:2]]})",
            reason=Reason.TENSOR_MISMATCH,
        )
    for name, shape in expected.items():
        e = tensors[name]
        if e.shape != shape or e.dtype not in LORA_DTYPES:
            rank = lora.rank_of(name.removeprefix(PEFT_PREFIX).rsplit(".lora_", 1)[0])
            raise InvalidArgument(
                f"tensor {name} has shape {list(e.shape)} ({e.dtype}); the base model and r={rank} "
                f"need {list(shape)} in F32, F16 or BF16",
                reason=Reason.TENSOR_MISMATCH,
            )


def _check_lora_tensors(lora: LoraShape, tensors: dict[str, TensorEntry]) -> None:
    """Without the base model: PEFT names, 2-D LoRA shapes of rank r, float dtypes."""
    if not tensors:
        raise InvalidArgument("the adapter holds no tensors", reason=Reason.TENSOR_MISMATCH)
    for name, e in tensors.items():
        kind = "A" if name.endswith(".lora_A.weight") else "B" if name.endswith(".lora_B.weight") else ""
        rank = lora.rank_of(name.removeprefix(PEFT_PREFIX).rsplit(".lora_", 1)[0])
        rank_ok = len(e.shape) == 2 and e.shape[0 if kind == "A" else 1] == rank
        if not name.startswith(PEFT_PREFIX) or not kind or not rank_ok or e.dtype not in LORA_DTYPES:
            raise InvalidArgument(
                f"tensor {name[:120]} ({e.dtype}, shape {list(e.shape)}) is not a LoRA weight of rank r={rank} in "
                "F32, F16 or BF16",
                reason=Reason.TENSOR_MISMATCH,
            )


def expected_lora_shapes(lora: LoraShape, base_shapes: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """PEFT state-dict key -> shape for every base linear layer the config targets, each of its
    own rank (rank_pattern's first match, else r)."""
    shapes: dict[str, tuple[int, int]] = {}
    for module, (out_f, in_f) in base_shapes.items():
        if targets(module, lora.target_modules):
            rank = lora.rank_of(module)
            shapes[f"{PEFT_PREFIX}{module}.lora_A.weight"] = (rank, in_f)
            shapes[f"{PEFT_PREFIX}{module}.lora_B.weight"] = (out_f, rank)
    return shapes


def targets(module: str, target_modules: tuple[str, ...]) -> bool:
    """PEFT's list matching: the module name equals a target or ends with '.' + target."""
    if ALL_LINEAR in target_modules:
        return True
    return any(module == t or module.endswith("." + t) for t in target_modules)
