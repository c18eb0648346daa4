"""Room for ingested groups: a byte budget over what the learner holds, each producer's share
of it, and the compact form samples are held in.

A producer is who the ingest service says sent a trajectory (security.caller_identity: its
bearer token's hash with auth on, else its peer host). Ingest (ingest/intake.py) asks here before a
trajectory opens a group and tells here when a group completes and when it leaves.

Invariants:
- the bytes held by ingested groups (being assembled, buffered or in a step) never exceed
  `ingest.max_pending_bytes`, and one producer never holds more than `ingest.producer_share`
  of those bytes or of `ingest.max_pending_groups`: whatever one producer sends, the others
  keep the rest of the room;
- a group reserves room for all its samples when it opens (`group_size` samples of
  `ingest.max_tokens`), so a later sample of an open group always fits: a full learner never
  leaves a group half accepted. Once complete it holds what its samples take;
- every hold is released exactly once: when its group is trained, dropped or expires;
- a held sample is arrays (int32 ids, float32 logprobs, int64 versions, int8 mask), about
  BYTES_PER_TOKEN bytes a token, not lists of Python objects (~85 bytes a token); what a sample
  and a group are charged (`sample_bytes`, `group_reservation`) is config.py's, so the config
  checks its sizes by the same rule.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from rollwire.common.errors import ResourceExhausted
from rollwire.common.reasons import Reason
from rollwire.learner.rollouts.groups import ScoredSample


def compact_sample(
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    versions: Sequence[int],
    mask: Sequence[bool],
    reward: float,
    correct: bool,
) -> ScoredSample:
    """The sample as held and trained: arrays, untrained tokens' logprobs and versions zeroed
    (ignored by the contract), so nothing a producer put there can reach the loss."""
    return ScoredSample(
        array("i", token_ids),
        array("f", [lp if m else 0.0 for lp, m in zip(logprobs, mask, strict=True)]),
        array("q", [v if m else 0 for v, m in zip(versions, mask, strict=True)]),
        "",
        "ingested",
        float(reward),
        bool(correct),
        loss_mask=array("b", [bool(m) for m in mask]),
    )


@dataclass
class Hold:
    """One group's room: who holds it and how many bytes."""

    producer: str
    nbytes: int


class Room:
    """The holds of every ingested group the learner has not let go of, by key (ingest/intake.py's)."""

    def __init__(self, max_bytes: int, max_groups: int, share: float, retry_after_s: float) -> None:
        self.max_bytes, self.max_groups, self.share, self.retry_after_s = max_bytes, max_groups, share, retry_after_s
        self.holds: dict[int, Hold] = {}
        self.bytes: Counter[str] = Counter()
        """Bytes held, by producer."""
        self.groups: Counter[str] = Counter()
        """Groups held, by producer."""
        self.held = 0
        """Bytes held by all producers."""

    @property
    def producer_groups(self) -> int:
        """Groups one producer may hold."""
        return max(1, int(self.share * self.max_groups))

    @property
    def producer_bytes(self) -> int:
        """Bytes one producer may hold."""
        return int(self.share * self.max_bytes)

    def reserve(self, key: int, producer: str, nbytes: int) -> None:
        """Hold `nbytes` for `producer`'s new group `key`, or raise the ResourceExhausted to answer."""
        who = producer or "this producer"
        if self.groups[producer] + 1 > self.producer_groups:
            self._refuse(
                f"{who} holds {self.groups[producer]} ingested groups, its share (ingest.producer_share "
                f"{self.share} of ingest.max_pending_groups {self.max_groups}); send this trajectory again after "
                "the hint, once its groups complete and train",
                Reason.INGEST_QUOTA,
            )
        if self.bytes[producer] + nbytes > self.producer_bytes:
            self._refuse(
                f"{who} holds {self.bytes[producer]} bytes of ingested groups and this group reserves {nbytes} more, "
                f"past its share of {self.producer_bytes} (ingest.producer_share {self.share} of "
                "ingest.max_pending_bytes); send it again after the hint, or complete its open groups first",
                Reason.INGEST_QUOTA,
            )
        if self.held + nbytes > self.max_bytes:
            self._refuse(
                f"the learner holds {self.held} bytes of ingested groups and this group reserves {nbytes} more, past "
                f"ingest.max_pending_bytes {self.max_bytes}; send this trajectory again after the hint",
                Reason.INGEST_FULL,
            )
        self.holds[key] = Hold(producer, 0)
        self.groups[producer] += 1
        self._resize(key, nbytes)

    def settle(self, key: int, nbytes: int) -> None:
        """Group `key` completed: it now holds what its samples take."""
        self._resize(key, nbytes)

    def release(self, key: int) -> None:
        """Group `key` left (trained, dropped, expired); a key not held is ignored."""
        if key not in self.holds:
            return
        self._resize(key, 0)
        hold = self.holds.pop(key)
        self.groups[hold.producer] -= 1
        if not self.groups[hold.producer]:
            del self.groups[hold.producer], self.bytes[hold.producer]

    def _resize(self, key: int, nbytes: int) -> None:
        hold = self.holds[key]
        self.bytes[hold.producer] += nbytes - hold.nbytes
        self.held += nbytes - hold.nbytes
        hold.nbytes = nbytes

    def _refuse(self, message: str, reason: Reason) -> None:
        raise ResourceExhausted(message, reason=reason, retry_after_s=self.retry_after_s)
