"""Scored trajectories from producers outside the learner, checked, grouped and buffered.

External producers (agent harnesses, environment servers, in any language) hand the learner
complete, scored samples through LearnerService.SubmitTrajectories (ingest/service.py turns
the messages into `Trajectory` here). Each one is judged on its own, in this order, and
answered with one typed status:

1. its shape, before any other work: sizes within `ingest.*` limits, loss mask, logprobs and
   versions parallel to the tokens, at least one trained token, numbers the learner's float32
   arithmetic can take (|reward| <= `ingest.max_abs_reward`, trained tokens' logprobs in
   [`ingest.min_logprob`, 0]), token ids inside the vocabulary (INVALID_ARGUMENT);
2. its group: the same size and prompt as the group's earlier samples, a group still open
   (INVALID_ARGUMENT GROUP_MISMATCH, FAILED_PRECONDITION GROUP_CLOSED);
3. its versions: every trained token's version is one the learner pushed (1..newest served;
   INVALID_ARGUMENT UNKNOWN_VERSION), and the oldest is at most `buffer.max_staleness` behind
   the version the next batch trains at (FAILED_PRECONDITION STALE_TRAJECTORY: resample);
4. room: a sample that would open a new group while `ingest.max_pending_groups` groups are
   being assembled or buffered, or past `ingest.max_pending_bytes`, is pushed back
   (RESOURCE_EXHAUSTED INGEST_FULL, retry hint); one past its producer's share of either
   (`ingest.producer_share`) too (INGEST_QUOTA). The byte budget, the shares and the compact
   form samples are held in are ingest/room.py's.

Invariants:
- every accepted trajectory ends exactly once and is counted: trained, or dropped with its
  group for a reason (zero_variance, stale, shutdown as the learner's own groups, or a step
  skipped for a non-finite gradient; expired when its group did not complete within
  `ingest.group_timeout_s`, or took no sample for `ingest.group_idle_s`). The counts are in
  `snapshot`;
- a completed group enters the buffer and the group ledger like one of the producer's groups,
  so it is trained exactly as they are (the buffer's staleness gate applies again at the step);
- environment and tool tokens (loss mask false) never reach the loss: their logprobs and
  versions are ignored from here on (ScoredSample.loss_mask).
"""

from __future__ import annotations

import math
import time
from array import array
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NoReturn

from rollwire.common.errors import (
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    RollwireError,
    Unavailable,
)
from rollwire.common.reasons import Reason
from rollwire.learner.config import IngestSection, group_reservation, sample_bytes
from rollwire.learner.ingest.room import Room, compact_sample
from rollwire.learner.rollouts.buffer import Buffer
from rollwire.learner.rollouts.groups import ScoredGroup, ScoredSample
from rollwire.learner.tasks.task import Example

MAX_ID_CHARS = 256


@dataclass
class Trajectory:
    """One scored sample as a producer sent it (LearnerService's Trajectory, off the wire)."""

    group_id: str
    group_size: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    loss_mask: list[bool]
    logprobs: list[float]
    token_versions: list[int]
    reward: float
    correct: bool = False
    trajectory_id: str = ""


@dataclass
class _OpenGroup:
    key: int
    """Its hold in the room (and, negated, its Example id once complete)."""
    producer: str
    size: int
    prompt: array
    opened_at: float
    last_at: float
    """When it took its last sample (ingest.group_idle_s)."""
    samples: list[ScoredSample] = field(default_factory=list)


class Ingest:
    """Judges trajectories and assembles their groups into the run's buffer.

    `newest` returns the newest adapter version the learner pushed (served); the buffer says
    which version the next batch trains at. Everything runs on the event loop: no locks."""

    def __init__(
        self,
        cfg: IngestSection,
        buffer: Buffer,
        newest: Callable[[], int],
        vocab_size: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg, self.buffer, self.newest, self.vocab_size, self.clock = cfg, buffer, newest, vocab_size, clock
        self.open: dict[str, _OpenGroup] = {}
        self.closed: dict[str, None] = {}
        """Group ids already used (completed or expired), oldest first; bounded by ingest.max_closed_ids."""
        self.stopping = False
        self.counts: Counter[str] = Counter()
        """Trajectories by outcome: accepted, trained, expired, or the refusal's reason."""
        self.groups: Counter[str] = Counter()
        """Ingested groups by outcome: completed, trained, expired."""
        self._keys = 0
        self.room = Room(cfg.max_pending_bytes, cfg.max_pending_groups, cfg.producer_share, cfg.retry_after_s)
        buffer.drop_observers.append(self._dropped_from_buffer)
        self.on_outcome: Callable[[str, int | None], None] = lambda outcome, staleness: None
        """Told each trajectory's outcome ("accepted" or the refusal's reason) and, when accepted, its
        staleness (versions between its oldest trained token and the version the next batch trains at)."""
        self.on_group: Callable[[ScoredGroup], None] = lambda group: None
        """Told each completed group (before the buffer judges it)."""

    # -- the contract -------------------------------------------------------------------------
    @property
    def oldest(self) -> int:
        """The oldest version a trained token may hold to be accepted now."""
        return max(1, self.buffer.next_train_version - self.buffer.max_staleness)

    def pending(self) -> int:
        """Ingested groups being assembled or waiting in the buffer."""
        return len(self.open) + self.buffer.count(lambda g: g.source == "ingest")

    def submit(self, t: Trajectory, producer: str = "") -> bool:
        """Accept `t` from `producer` (True when it completed its group) or raise the RollwireError to answer."""
        try:
            self.expire()
            check_shape(t, self.cfg, self.vocab_size)
            group = self._group_for(t)
            self._check_versions(t)
            if group is None:
                group = self._open(t, producer)
        except RollwireError as err:
            self.counts[err.reason] += 1
            self.on_outcome(err.reason, None)
            raise
        group.samples.append(
            compact_sample(t.token_ids, t.logprobs, t.token_versions, t.loss_mask, t.reward, t.correct)
        )
        group.last_at = self.clock()
        self.counts["accepted"] += 1
        oldest = min(v for v, m in zip(t.token_versions, t.loss_mask, strict=True) if m)
        self.on_outcome("accepted", max(0, self.buffer.next_train_version - oldest))
        if len(group.samples) < group.size:
            return False
        self._complete(t.group_id, group)
        return True

    def expire(self) -> int:
        """Drop (and count) every group that stayed incomplete for `ingest.group_timeout_s`, or took
        no sample for `ingest.group_idle_s`."""
        now, cfg, expired = self.clock(), self.cfg, 0
        for gid, group in list(self.open.items()):
            if now - group.opened_at > cfg.group_timeout_s or now - group.last_at > cfg.group_idle_s:
                self._expire(gid, group)
                expired += 1
        return expired

    def on_trained(self, batch: list[ScoredGroup], applied: bool = True) -> None:
        """A batch went into an optimiser step: count the ingested groups and samples in it, as
        trained, or as dropped when the step was skipped (`applied` false), and free their room."""
        ingested = [g for g in batch if g.source == "ingest"]
        self.groups["trained" if applied else "skipped"] += len(ingested)
        self.counts["trained" if applied else "dropped"] += sum(len(g.samples) for g in ingested)
        self._release(ingested)

    def _dropped_from_buffer(self, reason: str, groups: list[ScoredGroup]) -> None:
        """Count the ingested samples of groups the buffer dropped after taking them (stale, shutdown)."""
        ingested = [g for g in groups if g.source == "ingest"]
        self.counts["dropped"] += sum(len(g.samples) for g in ingested)
        self._release(ingested)

    def _release(self, groups: list[ScoredGroup]) -> None:
        for g in groups:
            self.room.release(-g.example.id)

    def stop(self) -> None:
        """Refuse what comes next; groups still incomplete are dropped as expired."""
        self.stopping = True
        for gid, group in list(self.open.items()):
            self._expire(gid, group)

    def _expire(self, gid: str, group: _OpenGroup) -> None:
        self._close(gid)
        self.room.release(group.key)
        self.counts["expired"] += len(group.samples)
        self.groups["expired"] += 1

    def snapshot(self) -> dict:
        return {
            "trajectories": dict(self.counts),
            "groups": dict(self.groups),
            "open_groups": len(self.open),
            "held_bytes": self.room.held,
        }

    # -- the steps ------------------------------------------------------------------------------
    def _group_for(self, t: Trajectory) -> _OpenGroup | None:
        if self.stopping:
            raise Unavailable("the learner is stopping and takes no more trajectories", reason=Reason.LEARNER_STOPPING)
        if t.group_id in self.closed:
            raise FailedPrecondition(
                f"group {t.group_id!r} is closed (completed, or expired incomplete); start a new group id",
                reason=Reason.GROUP_CLOSED,
            )
        group = self.open.get(t.group_id)
        if group is not None and group.size != t.group_size:
            raise InvalidArgument(
                f"group {t.group_id!r} was opened with group_size {group.size}, this trajectory says {t.group_size}",
                reason=Reason.GROUP_MISMATCH,
            )
        if group is not None and group.prompt != array("i", t.prompt_token_ids):
            raise InvalidArgument(
                f"every sample of group {t.group_id!r} must have the same prompt_token_ids (a GRPO group shares its "
                "prompt); this one differs",
                reason=Reason.GROUP_MISMATCH,
            )
        return group

    def _check_versions(self, t: Trajectory) -> None:
        trained = [v for v, m in zip(t.token_versions, t.loss_mask, strict=True) if m]
        newest, oldest = self.newest(), self.oldest
        unknown = next((v for v in trained if v < 1 or v > newest), None)
        if unknown is not None:
            raise InvalidArgument(
                f"a trained token has version {unknown}, which this learner never pushed (it has pushed 1..{newest}); "
                "send the versions the generator reported",
                reason=Reason.UNKNOWN_VERSION,
            )
        if min(trained) < oldest:
            raise FailedPrecondition(
                f"the oldest trained token has version {min(trained)}, more than buffer.max_staleness "
                f"({self.buffer.max_staleness}) behind version {self.buffer.next_train_version} that the next batch "
                f"trains at; sample again at version {newest} (accepted now: {oldest}..{newest})",
                reason=Reason.STALE_TRAJECTORY,
            )

    def _open(self, t: Trajectory, producer: str) -> _OpenGroup:
        if self.pending() >= self.cfg.max_pending_groups:
            raise ResourceExhausted(
                f"the learner holds {self.cfg.max_pending_groups} ingested groups (ingest.max_pending_groups) being "
                "assembled or waiting to train; send this trajectory again after the hint",
                reason=Reason.INGEST_FULL,
                retry_after_s=self.cfg.retry_after_s,
            )
        key = self._keys + 1
        self.room.reserve(key, producer, group_reservation(t.group_size, len(t.prompt_token_ids), self.cfg.max_tokens))
        self._keys = key
        now = self.clock()
        group = _OpenGroup(key, producer, t.group_size, array("i", t.prompt_token_ids), now, now)
        self.open[t.group_id] = group
        return group

    def _complete(self, gid: str, group: _OpenGroup) -> None:
        self._close(gid)
        self.room.settle(group.key, 4 * len(group.prompt) + sum(sample_bytes(len(s.token_ids)) for s in group.samples))
        scored = ScoredGroup(
            Example(-group.key, "", "", {"group_id": gid}),
            group.prompt,
            group.samples,
            adapter_version=min(v for s in group.samples for v in s.trained_versions),
            replica="ingest",
            source="ingest",
            producer=group.producer,
        )
        self.groups["completed"] += 1
        self.on_group(scored)
        ledger = self.buffer.ledger
        ledger.request()  # enters the ledger whole, as a producer's group enters it when its request ends
        ledger.generated()
        if not self.buffer.put(scored):
            self.counts["dropped"] += len(group.samples)
            self.room.release(group.key)

    def _close(self, gid: str) -> None:
        del self.open[gid]
        self.closed[gid] = None
        if len(self.closed) > self.cfg.max_closed_ids:  # a bounded memory of used ids, oldest forgotten first
            del self.closed[next(iter(self.closed))]


def check_shape(t: Trajectory, cfg: IngestSection, vocab_size: int) -> None:
    """Raise InvalidArgument unless `t` is well formed and within the limits (sizes first)."""
    n = len(t.token_ids)
    if len(t.prompt_token_ids) > cfg.max_prompt_tokens or n > cfg.max_tokens:
        raise InvalidArgument(
            f"the trajectory has {len(t.prompt_token_ids)} prompt and {n} later tokens; the limits are "
            f"ingest.max_prompt_tokens {cfg.max_prompt_tokens} and ingest.max_tokens {cfg.max_tokens}",
            reason=Reason.TRAJECTORY_TOO_LARGE,
        )
    if not t.group_id or len(t.group_id) > MAX_ID_CHARS or len(t.trajectory_id) > MAX_ID_CHARS:
        bad_trajectory(f"group_id is required and, like trajectory_id, at most {MAX_ID_CHARS} characters")
    if not 2 <= t.group_size <= cfg.max_group_size:
        bad_trajectory(f"group_size must be 2..{cfg.max_group_size} (ingest.max_group_size), got {t.group_size}")
    if not t.prompt_token_ids or not n:
        bad_trajectory("prompt_token_ids and token_ids must each hold at least one token")
    lengths = {"loss_mask": len(t.loss_mask), "logprobs": len(t.logprobs), "token_versions": len(t.token_versions)}
    uneven = {k: v for k, v in lengths.items() if v != n}
    if uneven:
        bad_trajectory(f"loss_mask, logprobs and token_versions must be parallel to token_ids ({n} tokens): {uneven}")
    if not any(t.loss_mask):
        bad_trajectory("no token has loss_mask true: a trajectory needs at least one token the model sampled")
    if not (math.isfinite(t.reward) and abs(t.reward) <= cfg.max_abs_reward):
        bad_trajectory(
            f"reward must be a finite number within +-{cfg.max_abs_reward:g} (ingest.max_abs_reward), got {t.reward}"
        )
    floor = cfg.min_logprob
    bad_lp = next((lp for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if m and not floor <= lp <= 0), None)
    if bad_lp is not None:
        bad_trajectory(
            f"a trained token's logprob must be a number in [{floor:g}, 0] (ingest.min_logprob: the replica never "
            f"samples a token that unlikely), got {bad_lp}"
        )
    for name, ids in (("prompt_token_ids", t.prompt_token_ids), ("token_ids", t.token_ids)):
        outside = next((i for i in ids if not 0 <= i < vocab_size), None)
        if outside is not None:
            raise InvalidArgument(
                f"{name} holds {outside}, outside the vocabulary (0..{vocab_size - 1})", reason=Reason.BAD_TOKEN_ID
            )


def bad_trajectory(message: str) -> NoReturn:
    """Raise the InvalidArgument BAD_TRAJECTORY that says `message`."""
    raise InvalidArgument(message, reason=Reason.BAD_TRAJECTORY)
