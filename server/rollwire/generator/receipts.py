"""A replica's receipts for the samples it finishes (rollwire.common.receipts; audit S11).

With `receipt_key_file` set, every SampleFinished carries a SampleReceipt: this replica's
signature over digests of what the sample was conditioned on and what it sampled here. The
servicer feeds each stream's events through a `StreamReceipts` as it sends them, so the digests
describe exactly the tokens, logprobs and versions the caller received.

Invariants:
- the context of sample i is the group's prompt as it ran (a session turn's whole history
  included) followed by the tokens the caller supplied for it in `resume`: tokens this replica
  did not sample in this request are context, never covered tokens;
- a receipt costs one Ed25519 signature (~60 µs) and three sha256 states per running sample;
  without a key nothing is computed.
"""

from __future__ import annotations

import time

from rollwire.common import receipts
from rollwire.common.signing import SigningKey
from rollwire.generator.types import GroupRequest, SampleDone, TokenDelta
from rollwire.v1 import generator_pb2 as pb


class Receipts:
    """The replica's receipt key; `stream(group)` tracks one Generate stream."""

    def __init__(self, key: SigningKey | None) -> None:
        self.key = key

    @classmethod
    def from_file(cls, path: str) -> Receipts:
        return cls(SigningKey.load(path) if path else None)

    def stream(self, group: GroupRequest) -> StreamReceipts | None:
        return StreamReceipts(self.key, group) if self.key is not None else None


class StreamReceipts:
    """The running digests of one group's samples, and their receipts once they finish."""

    def __init__(self, key: SigningKey, group: GroupRequest) -> None:
        self.key, self.group = key, group
        self._samples: dict[int, receipts.SampleDigest] = {}

    def add(self, delta: TokenDelta) -> None:
        digest = self._samples.setdefault(delta.sample_index, receipts.SampleDigest())
        digest.add(delta.token_ids, delta.logprobs, [delta.version] * len(delta.token_ids))

    def finish(self, done: SampleDone) -> pb.SampleReceipt:
        digest = self._samples.pop(done.sample_index, None) or receipts.SampleDigest()
        ids, logprobs, versions = digest.digests()
        context = self.group.prompt_ids + self.group.resume.get(done.sample_index, [])
        receipt = pb.SampleReceipt(
            adapter=self.group.adapter.name,
            context_sha256=receipts.ids_digest(context),
            tokens_sha256=ids,
            logprobs_sha256=logprobs,
            versions_sha256=versions,
            tokens=digest.tokens,
            sample_id=f"{self.group.request_id}:{done.sample_index}",
            issued_unix_ms=int(time.time() * 1000),
        )
        return receipts.sign(receipt, self.key)
