"""Ingestion's provenance check: every trained token lies in a span a trusted replica signed.

With `ingest.receipt_keys_file` set (the replicas' public keys, a trust file as
`rollwire keys generate` writes its entries), a trajectory is taken only when its receipts
(Trajectory.receipts: each a replica's SampleReceipt placed where its tokens start) cover every
token whose loss mask is true, and each receipt is signed by a trusted key, names this learner's
adapter (or its tenant-qualified name), is not older than `ingest.receipt_max_age_s`, and holds
the digests of exactly the trajectory's tokens before its span (the context the replica was
given), and of the span's ids, logprobs and versions. So a producer can no longer train the
learner on tokens no policy sampled (audit S11), whatever logprobs it computes for them.

Invariants:
- limits before work: at most `MAX_RECEIPTS` receipts, spans in order and inside the trajectory,
  checked before any digest or signature;
- a receipt trains once: its sample id is claimed when its trajectory is taken (`claim`, called
  with no await between it and the buffer's submit, so two streams cannot both take one), and a
  refused trajectory claims nothing (a producer may resend it); the newest `max_claimed` ids are
  remembered;
- each refusal is INVALID_ARGUMENT naming the first token or receipt at fault: RECEIPT_MISSING
  for a trained token no receipt covers, BAD_RECEIPT for a receipt that does not hold.
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections import OrderedDict
from collections.abc import Sequence

from rollwire.common import receipts
from rollwire.common.errors import InvalidArgument
from rollwire.common.manifest import TENANT_SEPARATOR
from rollwire.common.reasons import Reason
from rollwire.common.signing import TrustedKeys
from rollwire.v1 import generator_pb2 as pb
from rollwire.v1 import learner_pb2 as lpb

MAX_RECEIPTS = 256
"""Receipts one trajectory may carry (one per model turn)."""


def _bad(message: str) -> InvalidArgument:
    return InvalidArgument(message, reason=Reason.BAD_RECEIPT)


class ReceiptCheck:
    """Checks and claims the receipts of trajectories for `adapter_name`; see the module docstring."""

    def __init__(self, keys: TrustedKeys, adapter_name: str, max_age_s: float, max_claimed: int = 100_000) -> None:
        self.keys, self.adapter_name, self.max_age_s, self.max_claimed = keys, adapter_name, max_age_s, max_claimed
        self._claimed: OrderedDict[str, None] = OrderedDict()

    def verify(self, t: lpb.Trajectory) -> list[str]:
        """The sample ids of `t`'s receipts when they cover its trained tokens; raise the refusal otherwise."""
        spans = self._spans(t)
        ids, logprobs, versions = list(t.token_ids), list(t.logprobs), list(t.token_versions)
        running, hashed = hashlib.sha256(struct.pack(f"<{len(t.prompt_token_ids)}i", *t.prompt_token_ids)), 0
        now_ms = time.time() * 1000
        for k, (start, end, r) in enumerate(spans):
            where = f"receipt {k} (tokens {start}..{end - 1})"
            if not receipts.verify(r, self.keys.keys):
                raise _bad(f"{where} is not signed by a replica this learner trusts (signer {r.signer[:64]!r})")
            if r.adapter != self.adapter_name and not r.adapter.endswith(TENANT_SEPARATOR + self.adapter_name):
                raise _bad(f"{where} was sampled from {r.adapter[:128]!r}, not from {self.adapter_name!r}")
            age_s = (now_ms - r.issued_unix_ms) / 1000
            if age_s > self.max_age_s:
                raise _bad(f"{where} is {age_s:.0f} s old, over ingest.receipt_max_age_s ({self.max_age_s:g})")
            running.update(struct.pack(f"<{start - hashed}i", *ids[hashed:start]))  # one pass over the context
            hashed = start
            why = receipts.covers(r, (), ids[start:end], logprobs[start:end], versions[start:end], running.digest())
            if why is not None:
                raise _bad(f"{where} does not describe them: {why}")
            if r.sample_id in self._claimed:
                raise _bad(f"{where} was already trained on (sample {r.sample_id[:128]!r}); each sample trains once")
        uncovered = first_uncovered(t.loss_mask, [(s, e) for s, e, _ in spans])
        if uncovered is not None:
            raise InvalidArgument(
                f"token {uncovered} is trained (loss_mask true) but no receipt covers it: attach the SampleReceipt "
                "the replica sent with each model turn (Trajectory.receipts), placed where the turn's tokens start",
                reason=Reason.RECEIPT_MISSING,
            )
        return [r.sample_id for _, _, r in spans]

    def claim(self, sample_ids: Sequence[str]) -> None:
        """Mark a taken trajectory's receipts as used, on the event loop (no await between this
        call and the buffer's submit). `verify` runs in a worker thread, so its look at the claimed
        ids may be stale: this is the check that holds, two streams' copies of one receipt included."""
        for sample_id in sample_ids:
            if sample_id in self._claimed:
                raise _bad(f"sample {sample_id[:128]!r} was already trained on; each sample trains once")
        for sample_id in sample_ids:
            self._claimed[sample_id] = None
        while len(self._claimed) > self.max_claimed:
            self._claimed.popitem(last=False)

    def release(self, sample_ids: Sequence[str]) -> None:
        """Undo `claim` for a trajectory the buffer then refused."""
        for sample_id in sample_ids:
            self._claimed.pop(sample_id, None)

    @staticmethod
    def _spans(t: lpb.Trajectory) -> list[tuple[int, int, pb.SampleReceipt]]:
        if len(t.receipts) > MAX_RECEIPTS:
            raise _bad(f"the trajectory carries {len(t.receipts)} receipts; at most {MAX_RECEIPTS} (one per turn)")
        spans, end = [], 0
        for k, span in enumerate(t.receipts):
            stop = span.start + span.receipt.tokens
            if span.start < end or stop > len(t.token_ids):
                raise _bad(
                    f"receipt {k} covers tokens {span.start}..{stop - 1}: spans must be in order, not overlap, and "
                    f"lie within the trajectory's {len(t.token_ids)} tokens"
                )
            spans.append((span.start, stop, span.receipt))
            end = stop
        return spans


def first_uncovered(mask: Sequence[bool], spans: Sequence[tuple[int, int]]) -> int | None:
    """The first trained position outside every [start, end) span, or None."""
    k = 0
    for j, trained in enumerate(mask):
        while k < len(spans) and spans[k][1] <= j:
            k += 1
        if trained and not (k < len(spans) and spans[k][0] <= j):
            return j
    return None
