"""Pushing adapter versions to the target without holding up training.

Invariants:
- at most one push is in flight; a version published while another is being pushed waits
  as the pending one, and a newer version replaces (supersedes) a pending one, counted;
- versions are pushed in increasing order, so the target never sees one go backwards;
- `served` only grows, and only when the target confirmed the version is served;
- the synchronous mode uses the same path with `wait=True`: publish returns once the
  version is served.
Transient failures (UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, ABORTED) are
retried until a newer version supersedes them; any other refusal is fatal and raised to
the caller on its next publish or wait, with the target's own sentence. Any other exception
in the worker (a bug, a client that breaks its contract) is fatal the same way, as INTERNAL
naming it: a caller waiting for a version is woken, never left waiting.
A payload holding a NaN or an infinity is never pushed: `publish` raises NonFiniteWeights
(the same torch-free check the replicas and the proxy run), which stops the run.
An unsigned version leaves its sha256 to the target (`sha256_by_receiver`): the push starts
after the payload's BLAKE3 alone, and the target names the sha256 from the verified bytes.
A version may go with its probe (`probe_of`: the learner's own logprobs of a few fixed token
sequences under the very weights pushed, docs/protocol.md "Proof"), which every replica holds its
engine to before it serves the version; the probe travels with its version, superseded with it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from rollwire.client.probes import model_probe
from rollwire.common.errors import Internal, RollwireError
from rollwire.common.lora import LoraShape
from rollwire.common.retries import PUSH_TRANSIENT
from rollwire.common.safetensors_header import HeaderError, header_length, nonfinite_tensor, read_entries
from rollwire.common.signing import SigningKey
from rollwire.learner.rollouts.buffer import Signal
from rollwire.runtime.logs import get_logger
from rollwire.v1 import generator_pb2 as pb

log = get_logger(__name__)


class NonFiniteWeights(RuntimeError):
    """The weights to publish hold NaN or infinite values: the run diverged and must stop."""


def check_finite(version: int, payload: bytes) -> None:
    """Raise NonFiniteWeights when a float tensor of the safetensors `payload` is not finite."""
    try:
        entries = read_entries(payload)
    except HeaderError:
        return  # not ours to judge: the target refuses a malformed payload with its own sentence
    bad = nonfinite_tensor(payload, entries, 8 + header_length(payload))
    if bad is not None:
        raise NonFiniteWeights(
            f"adapter version {version} holds NaN or infinite values in tensor {bad}; the run diverged and is stopped "
            "without publishing it (lower train.lr or resume from an earlier checkpoint)"
        )


@dataclass(frozen=True)
class PushRecord:
    version: int
    seconds: float
    outcome: str
    """ok | superseded | retried | failed."""


class Publisher:
    """Pushes `name` versions through `client`; `served` is the newest confirmed version."""

    def __init__(
        self,
        client,
        name: str,
        fingerprint: str,
        lora: LoraShape,
        changed: Signal,
        retry_backoff_s: float = 0.5,
        on_push: Callable[[PushRecord], None] = lambda record: None,
        *,
        signing_key: SigningKey | None = None,
    ) -> None:
        self.client, self.name, self.fingerprint, self.lora = client, name, fingerprint, lora
        self.signing_key = signing_key
        """Signs every version pushed (learner's signing_key_file); None: unsigned."""
        self.changed = changed
        self.retry_backoff_s = retry_backoff_s
        self.on_push = on_push
        self.served = 0
        self._pending: tuple[int, bytes, pb.AdapterProbe | None] | None = None
        self._last: tuple[int, bytes, pb.AdapterProbe | None] | None = None
        self._worker: asyncio.Task | None = None
        self._fatal: RollwireError | None = None

    async def publish(
        self, version: int, payload: bytes, *, wait: bool = False, probe: pb.AdapterProbe | None = None
    ) -> None:
        """Queue `version` for pushing (with its `probe`, when given); with `wait`, return once it is served."""
        self._raise_fatal()
        if len(payload) > 1 << 16:
            await asyncio.to_thread(check_finite, version, payload)
        else:
            check_finite(version, payload)
        if self._pending is not None:
            self.on_push(PushRecord(self._pending[0], 0.0, "superseded"))
        self._pending = (version, payload, probe)
        self._ensure_worker()
        if wait:
            await self.wait_served(version)

    async def wait_served(self, version: int) -> None:
        await self.changed.wait_for(lambda: self.served >= version or self._fatal is not None)
        self._raise_fatal()

    def republish(self) -> None:
        """Push the newest served version again (replicas that lost it load it; others say already loaded)."""
        if self._last is not None and self._pending is None and not self.busy:
            self._pending = self._last
            self._ensure_worker()

    @property
    def busy(self) -> bool:
        return self._worker is not None and not self._worker.done()

    async def close(self) -> None:
        """Finish the push in flight and the pending one."""
        if self._worker is not None:
            await self._worker
        self._raise_fatal()

    def clear_error(self) -> None:
        """Forget a refusal the caller has dealt with (e.g. by moving to a higher version)."""
        self._fatal = None

    def _raise_fatal(self) -> None:
        if self._fatal is not None:
            raise self._fatal

    def _ensure_worker(self) -> None:
        if not self.busy:
            self._worker = asyncio.create_task(self._drain(), name="rollwire-publisher")

    async def _drain(self) -> None:
        version = 0
        try:
            while self._pending is not None and self._fatal is None:
                version, payload, probe = self._pending
                self._pending = None
                await self._push(version, payload, probe)
        except Exception as exc:  # a fault of ours or the client's, not a refusal: never a silent hang
            log.exception("publisher_failed", version=version, error=f"{type(exc).__name__}: {exc}"[:300])
            self.on_push(PushRecord(version, 0.0, "failed"))
            self._fatal = Internal(
                f"publishing version {version} failed inside the learner ({type(exc).__name__}: {str(exc)[:200]}); "
                "the learner's log has the traceback"
            )
            self.changed.notify()

    async def _push(self, version: int, payload: bytes, probe: pb.AdapterProbe | None = None) -> None:
        started = time.monotonic()
        extra = {"probe": probe} if probe is not None else {}  # a client that predates probes is called as before
        while True:
            try:
                result = await self.client.push_adapter(
                    self.name,
                    version,
                    payload,
                    self.lora,
                    self.fingerprint,
                    signing_key=self.signing_key,
                    sha256_by_receiver=self.signing_key is None,  # its BLAKE3 alone before the first byte
                    **extra,
                )
                break
            except RollwireError as exc:
                if exc.code not in PUSH_TRANSIENT:
                    log.error("push_refused", version=version, code=exc.code.name, reason=exc.reason, error=exc.message)
                    self.on_push(PushRecord(version, time.monotonic() - started, "failed"))
                    self._fatal = exc
                    self.changed.notify()
                    return
                log.warning("push_retry", version=version, code=exc.code.name, error=exc.message)
                self.on_push(PushRecord(version, time.monotonic() - started, "retried"))
                if self._pending is not None:  # a newer version will be pushed instead
                    self.on_push(PushRecord(version, time.monotonic() - started, "superseded"))
                    return
                await asyncio.sleep(self.retry_backoff_s)
        seconds = time.monotonic() - started
        failed = [f"{r.replica}: {r.code} {r.message}" for r in result.replicas if r.code != "OK"]
        if failed:
            log.warning("push_partial", version=version, failed_replicas=failed)
        log.info("pushed", version=version, seconds=round(seconds, 4), already_loaded=result.already_loaded)
        self._last = (version, payload, probe)
        self.served = max(self.served, version)
        self.on_push(PushRecord(version, seconds, "ok"))
        self.changed.notify()


def probe_of(model, version: int) -> pb.AdapterProbe:
    """The probe of the weights `model` (the learner's PEFT model) holds now, taken as every
    publisher takes one (rollwire.client.probes.model_probe: float32, eval mode, 4 fixed sequences
    seeded by `version`). Call it where the payload is taken, before the next step changes the weights."""
    return model_probe(model, version)
