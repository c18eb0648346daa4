"""A version's behavioural proof (AdapterProbe): what a probe may hold, how two sets of numbers compare.

A publisher attaches to a version a few token sequences and the logprobs its own forward gave
their continuations under that version; every replica scores them through its engine before it
serves the version (rollwire.generator.proof) and a proxy re-checks them later
(rollwire.proxy.publish.proof). This module is the one place for what both sides share.

Invariants:
- a probe is bounded before any work: at most MAX_PROBE_SEQUENCES sequences and
  MAX_PROBE_TOKENS tokens in all (counted from the lengths, before an id is scanned), one
  expected entry per sequence with one finite logprob <= 0 per continuation token; anything
  else is the client's fault (INVALID_ARGUMENT, BAD_PROBE or PROBE_TOO_LARGE) and is refused
  before a payload byte is read, so it never counts against a replica;
- `probe_digest` is a canonical encoding (ids and float32 logprobs, length-prefixed): the
  signature covers it (rollwire.common.signing), so no hop can change the numbers of a signed
  version without failing its signature;
- `compare` reports the largest |got - expected| and where; a NaN or a missing token counts
  as an infinite gap (never as a pass).

Tolerances are per engine (`DEFAULT_TOLERANCES`): float32 forwards of one model agree to ~1e-6
(an honest transformers or vLLM replica of the tiny model: 4.8e-7 from the publisher's PEFT
forward), while a LoRA whose B matrices are scaled by 1.05 moved them by 2e-2 to 4.5e-2
(measured 2026-12-07), so 1e-4 on transformers and 1e-3 on the served engines separate the two.
"""

from __future__ import annotations

import hashlib
import math
import random
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from rollwire.common.errors import InvalidArgument
from rollwire.common.reasons import Reason
from rollwire.v1 import generator_pb2 as pb

MAX_PROBE_SEQUENCES = 16
MAX_PROBE_TOKENS = 2048
"""Prompt plus continuation tokens over all of a probe's sequences."""

PASSED, FAILED, DISPUTED, UNSUPPORTED = "passed", "failed", "disputed", "unsupported"
OUTCOMES = (PASSED, FAILED, DISPUTED, UNSUPPORTED)
"""AdapterProof.outcome and the proof metrics' `outcome` label."""

DEFAULT_TOLERANCES = {"transformers": 1e-4, "vllm": 1e-3, "sglang": 1e-3, "scripted": 1e-6}
"""Largest |Δlogprob| a replica of each engine may show and still pass; an engine not named: 1e-3.
vLLM and SGLang score with their own kernels: an honest float32 vLLM replica of the tiny model measured 4.8e-7;
in bf16 a replica differs from a float32 publisher by far more: raise it there (docs/protocol.md, "Proof")."""
DEFAULT_TOLERANCE = 1e-3


def tolerance_for(engine: str, configured: float = 0.0) -> float:
    """The configured tolerance, or the engine's default when it is 0."""
    return configured if configured > 0 else DEFAULT_TOLERANCES.get(engine, DEFAULT_TOLERANCE)


def check_probe(probe: pb.AdapterProbe) -> None:
    """Refuse a probe that is malformed or too big (the module's invariants); ids against the
    vocabulary are the replica's check (it knows its vocabulary)."""
    count = len(probe.sequences)
    if count == 0:
        raise InvalidArgument(
            "the adapter's probe has no sequence; send at least one, or no probe", reason=Reason.BAD_PROBE
        )
    if count > MAX_PROBE_SEQUENCES:
        raise InvalidArgument(
            f"the adapter's probe has {count} sequences; a probe holds at most {MAX_PROBE_SEQUENCES}",
            reason=Reason.PROBE_TOO_LARGE,
        )
    total = sum(len(s.prompt_token_ids) + len(s.continuation_token_ids) for s in probe.sequences)
    if total > MAX_PROBE_TOKENS:
        raise InvalidArgument(
            f"the adapter's probe holds {total} tokens; a probe holds at most {MAX_PROBE_TOKENS} (prompts and "
            "continuations together): send fewer or shorter sequences",
            reason=Reason.PROBE_TOO_LARGE,
        )
    if len(probe.expected) != count:
        raise InvalidArgument(
            f"the adapter's probe has {count} sequences and {len(probe.expected)} expected entries; give one per "
            "sequence",
            reason=Reason.BAD_PROBE,
        )
    for i, (s, e) in enumerate(zip(probe.sequences, probe.expected, strict=True)):
        if not s.prompt_token_ids or not s.continuation_token_ids:
            raise InvalidArgument(
                f"probe sequence {i} needs at least one prompt and one continuation token", reason=Reason.BAD_PROBE
            )
        if len(e.logprobs) != len(s.continuation_token_ids):
            raise InvalidArgument(
                f"probe sequence {i} has {len(s.continuation_token_ids)} continuation tokens and {len(e.logprobs)} "
                "expected logprobs; give one per continuation token",
                reason=Reason.BAD_PROBE,
            )
        if not all(math.isfinite(x) and x <= 0.0 for x in e.logprobs):
            raise InvalidArgument(
                f"probe sequence {i} has an expected logprob that is not a finite number <= 0", reason=Reason.BAD_PROBE
            )


def check_ids(probe: pb.AdapterProbe, vocab_size: int, max_context: int) -> None:
    """Refuse a probe whose ids are outside the vocabulary or whose sequence overflows the context."""
    for i, s in enumerate(probe.sequences):
        ids = (*s.prompt_token_ids, *s.continuation_token_ids)
        if max_context and len(ids) > max_context:
            raise InvalidArgument(
                f"probe sequence {i} has {len(ids)} tokens; the model attends to at most {max_context}",
                reason=Reason.BAD_PROBE,
            )
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidArgument(
                f"probe sequence {i} holds token ids {bad[:5]} outside the vocabulary [0, {vocab_size})",
                reason=Reason.BAD_PROBE,
            )


def probe_digest(probe: pb.AdapterProbe) -> bytes:
    """SHA-256 of the probe's canonical encoding: what a signature covers."""
    h = hashlib.sha256(b"rollwire-probe-v1\0")
    h.update(struct.pack(">QI", probe.seed, len(probe.sequences)))
    for s, e in zip(probe.sequences, probe.expected, strict=False):
        for ids in (s.prompt_token_ids, s.continuation_token_ids):
            h.update(struct.pack(f">I{len(ids)}i", len(ids), *ids))
        h.update(struct.pack(f">I{len(e.logprobs)}f", len(e.logprobs), *e.logprobs))
    h.update(struct.pack(">I", len(probe.expected)))
    return h.digest()


@dataclass(frozen=True)
class Gap:
    """The largest |got - expected| of a proof and where it was."""

    max_abs: float
    sequence: int = 0
    token: int = 0

    @property
    def where(self) -> str:
        return f"sequence {self.sequence} token {self.token}"

    def within(self, tolerance: float) -> bool:
        return self.max_abs <= tolerance


def compare(expected: Sequence[Sequence[float]], got: Sequence[Sequence[float]]) -> Gap:
    """The gap between two sets of per-sequence logprobs (the module's invariants)."""
    worst = Gap(0.0)
    if len(expected) != len(got):
        return Gap(math.inf)
    for i, (e, g) in enumerate(zip(expected, got, strict=True)):
        if len(e) != len(g):
            return Gap(math.inf, i, min(len(e), len(g)))
        for j, (a, b) in enumerate(zip(e, g, strict=True)):
            d = abs(a - b)
            if math.isnan(d):
                d = math.inf
            if d > worst.max_abs:
                worst = Gap(d, i, j)
    return worst


def expected_of(probe: pb.AdapterProbe) -> list[list[float]]:
    return [list(e.logprobs) for e in probe.expected]


def score_request(probe: pb.AdapterProbe, name: str, version: int, request_id: str = "") -> pb.ScoreRequest:
    """The Score that proves `name` v`version` with `probe` (through a replica's Score)."""
    return pb.ScoreRequest(
        request_id=request_id,
        adapter=pb.AdapterRef(name=name, version=version),
        sequences=list(probe.sequences),
    )


def build_probe(
    sequences: Sequence[tuple[Sequence[int], Sequence[int]]], logprobs: Sequence[Sequence[float]], seed: int = 0
) -> pb.AdapterProbe:
    """A probe from (prompt, continuation) pairs and their logprobs, checked."""
    probe = pb.AdapterProbe(
        sequences=[pb.ScoreSequence(prompt_token_ids=p, continuation_token_ids=c) for p, c in sequences],
        expected=[pb.SequenceScore(logprobs=list(lp)) for lp in logprobs],
        seed=seed,
    )
    check_probe(probe)
    return probe


def fixed_sequences(
    seed: int = 0, count: int = 4, prompt: int = 8, continuation: int = 8, ids_below: int = 32
) -> list[tuple[list[int], list[int]]]:
    """A few deterministic token sequences over ids [3, ids_below): what a publisher with no data
    of its own, or the proxy for an unprobed version, scores (every vocabulary has these ids;
    0-2 are left out, where tokenizers keep their special tokens)."""
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(3, ids_below) for _ in range(prompt)],
            [rng.randrange(3, ids_below) for _ in range(continuation)],
        )
        for _ in range(count)
    ]


__all__ = [
    "DEFAULT_TOLERANCES",
    "DISPUTED",
    "FAILED",
    "MAX_PROBE_SEQUENCES",
    "MAX_PROBE_TOKENS",
    "OUTCOMES",
    "PASSED",
    "UNSUPPORTED",
    "Gap",
    "build_probe",
    "check_ids",
    "check_probe",
    "compare",
    "expected_of",
    "fixed_sequences",
    "probe_digest",
    "score_request",
    "tolerance_for",
]
