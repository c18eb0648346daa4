"""Multi-turn sessions on the server that received them: a bounded store of token histories.

A session is one agent episode: every turn sends only its new tokens (environment or tool
output) and the model answers conditioned on the whole history. The front server of a
turn (a proxy, or a replica called directly) keeps the history here and the model sees
`history + new` as one prompt; the reply's exact token ids are appended, never re-tokenized.

Invariants:
- sessions are keyed by (caller identity, id): a caller can neither read nor extend another
  caller's session, whatever id it guesses;
- every limit is checked before any work: the id's form, `n == 1`, the history plus this
  turn plus `max_new_tokens` within the model's context, one turn at a time per session,
  at most `max_sessions` sessions (`max_sessions_per_client` per caller) and
  `max_total_tokens` tokens held or reserved by running turns;
- room for a new session or a turn is made only by forgetting sessions idle at least
  `min_idle_s` (least recently used first; expired ones, past `ttl_s`, always go first):
  a flood of new sessions is refused (RESOURCE_EXHAUSTED, SESSIONS_FULL) instead of
  evicting the sessions that are in use;
- a turn changes the history only when it completed (`Turn.commit`); a failed, refused or
  cancelled turn leaves the session exactly as it was, so the caller may send it again;
  a session whose first turn failed is forgotten;
- all of it runs on the server's event loop: no locks, every operation O(1) amortised.
"""

from __future__ import annotations

import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from pydantic import Field

from rollwire.common.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from rollwire.common.reasons import Reason
from rollwire.runtime.config import Section
from rollwire.runtime.metrics import MetricFactory
from rollwire.v1 import generator_pb2 as pb

SESSION_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
EVICTION_CAUSES = ("ttl", "lru", "ended")
"""Why a session was forgotten: expired, made room (least recently used), or its caller ended it."""
TURN_OUTCOMES = ("completed", "failed", "refused")
"""How a turn ended: appended to its session, ended with an error after it started, or refused before any work."""


class SessionSection(Section):
    """Bounds of the sessions one server holds (GenerateRequest.session, docs/sessions.md)."""

    max_sessions: int = Field(default=4096, ge=0)
    """Sessions held at once; 0 refuses every session turn."""
    max_sessions_per_client: int = Field(default=1024, ge=1)
    """Sessions one caller identity (token, or peer host without auth) holds at once."""
    max_total_tokens: int = Field(default=8_000_000, ge=1)
    """Tokens held over all histories, plus what running turns may add (their new tokens and max_new_tokens)."""
    ttl_s: float = Field(default=900.0, gt=0)
    """A session not used for this long is forgotten."""
    min_idle_s: float = Field(default=30.0, ge=0)
    """Only sessions idle this long are forgotten to make room; otherwise a new one is refused (SESSIONS_FULL)."""
    retry_after_s: float = Field(default=2.0, ge=0)
    """Retry hint of SESSIONS_FULL."""


def check_turn(request: pb.GenerateRequest) -> str:
    """The session id of a request that names one, checked with its `n`; "" without a session."""
    if not request.HasField("session"):
        return ""
    sid = request.session.id
    if not SESSION_ID_RE.fullmatch(sid):
        shown = sid[:40] + ("..." if len(sid) > 40 else "")
        raise InvalidArgument(
            f"session.id {shown!r} ({len(sid)} characters) is not a session id: use 1 to 128 letters, digits, "
            "'-', '_', '.' or ':' (a uuid, say)",
            reason=Reason.BAD_SESSION,
        )
    if request.n != 1:
        raise InvalidArgument(
            f"n is {request.n} but a session turn continues one history, so n must be 1; send a group of n "
            "samples without a session (or one session per sample)",
            reason=Reason.BAD_SESSION,
        )
    return sid


@dataclass(eq=False)
class Session:
    """One episode's exact token history and where and how it is served."""

    key: tuple[str, str]
    """(caller identity, session id)."""
    tokens: list[int] = field(default_factory=list)
    """Every token so far: prompts, environment turns and the model's replies, in order."""
    adapter: str = ""
    """The adapter of the first turn; later turns must name the same one."""
    version: int = 0
    """The pinned version (resolved on the first turn); 0 while unknown or when following."""
    follow: bool = False
    """Each turn resolves the newest version (AdapterRef.follow) instead of the pinned one."""
    replica: str = ""
    """Address of the replica that served the last turn (a proxy's sticky choice)."""
    turns: int = 0
    """Completed turns."""
    used: float = 0.0
    """time.monotonic() of the last turn's start or end."""
    running: Turn | None = None
    """The turn in progress, if any (one at a time)."""


class SessionMetrics:
    """The store's series: `<prefix>sessions_active`, `<prefix>session_evictions_total{cause}`,
    `<prefix>session_turns_total{outcome}`."""

    def __init__(self, make: MetricFactory) -> None:
        self.active = make.gauge("sessions_active", "Multi-turn sessions held now.")
        self.evictions = make.counter(
            "session_evictions_total", "Sessions forgotten, by cause (ttl, lru, ended).", ["cause"]
        )
        self.turns = make.counter(
            "session_turns_total", "Session turns by outcome (completed, failed, refused).", ["outcome"]
        )
        for cause in EVICTION_CAUSES:
            self.evictions.labels(cause)
        for outcome in TURN_OUTCOMES:
            self.turns.labels(outcome)


class SessionStore:
    """Sessions by (caller, id), least recently used first; see the module docstring."""

    def __init__(self, limits: SessionSection, metrics: SessionMetrics, clock=time.monotonic) -> None:
        self.limits, self.metrics, self.clock = limits, metrics, clock
        self._sessions: OrderedDict[tuple[str, str], Session] = OrderedDict()
        self._per_client: dict[str, int] = {}
        self.tokens = 0
        """Tokens held in histories plus those reserved by running turns."""

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, caller: str, sid: str) -> Session | None:
        return self._sessions.get((caller, sid))

    def begin(
        self,
        caller: str,
        sid: str,
        new_tokens: int,
        max_new_tokens: int,
        max_context: int,
        adapter: str = "",
        max_prompt: int = 0,
        expect: int = 0,
    ) -> Turn:
        """Start a turn of session `sid` (a new session when unknown), or refuse it before any
        work. `new_tokens`: this turn's prompt length (an upper bound when not yet tokenized);
        `max_context`: the model's context, `max_prompt`: the longest prompt a replica takes
        (0: unknown, not checked here); `adapter`: the adapter the turn names, which must be
        the session's; `expect`: the history length the caller believes it holds (0: any)."""
        try:
            self._expire()
            session = self._sessions.get((caller, sid))
            if session is not None and session.turns and adapter != session.adapter:
                raise InvalidArgument(
                    f"session {sid!r} samples from adapter {session.adapter or '(base model)'!r} but this turn names "
                    f"{adapter or '(base model)'!r}; a session keeps its adapter, start another session to change it",
                    reason=Reason.BAD_SESSION,
                )
            if session is not None and session.running is not None:
                raise FailedPrecondition(
                    f"session {sid!r} already has a turn running; send its next turn once that one has ended",
                    reason=Reason.SESSION_BUSY,
                )
            held = len(session.tokens) if session else 0
            if expect and expect != held:
                raise FailedPrecondition(
                    f"session {sid!r} holds {held} tokens here but the caller expects {expect} (it expired or was "
                    "evicted); send the whole history as the first turn of the session again",
                    reason=Reason.SESSION_LOST,
                )
            if max_prompt and held + new_tokens > max_prompt:
                raise InvalidArgument(
                    f"session {sid!r} holds {held} tokens; with this turn's {new_tokens} new tokens its prompt would "
                    f"be over the {max_prompt} tokens a replica accepts; end the episode",
                    reason=Reason.PROMPT_TOO_LONG,
                )
            if max_context and held + new_tokens + max_new_tokens > max_context:
                raise InvalidArgument(
                    f"session {sid!r} holds {held} tokens; with this turn's {new_tokens} new tokens and max_new_tokens "
                    f"{max_new_tokens} it would exceed the model's context of {max_context} tokens; end the episode "
                    "(or ask for fewer tokens)",
                    reason=Reason.CONTEXT_TOO_LONG,
                )
            if session is None:
                session = self._create(caller, sid)
            self._reserve(session, new_tokens + max_new_tokens)
        except Exception:
            self.metrics.turns.labels("refused").inc()
            raise
        turn = Turn(self, session, new_tokens + max_new_tokens)
        session.running, session.used = turn, self.clock()
        self._sessions.move_to_end(session.key)
        return turn

    def _create(self, caller: str, sid: str) -> Session:
        lim = self.limits
        if self._per_client.get(caller, 0) >= lim.max_sessions_per_client:
            raise self._full(f"this caller already holds {lim.max_sessions_per_client} sessions (its limit)")
        while len(self._sessions) >= lim.max_sessions:
            if not self._evict_idle():
                raise self._full(f"this server holds {len(self._sessions)} sessions (limit {lim.max_sessions})")
        session = Session((caller, sid), used=self.clock())
        self._sessions[session.key] = session
        self._per_client[caller] = self._per_client.get(caller, 0) + 1
        self.metrics.active.set(len(self._sessions))
        return session

    def _reserve(self, session: Session, tokens: int) -> None:
        while self.tokens + tokens > self.limits.max_total_tokens:
            if not self._evict_idle(keep=session):
                if session.turns == 0:
                    self._forget(session, "")
                raise self._full(
                    f"sessions here hold {self.tokens} tokens and this turn needs room for {tokens} more "
                    f"(limit {self.limits.max_total_tokens})"
                )
        self.tokens += tokens

    def _full(self, why: str) -> ResourceExhausted:
        return ResourceExhausted(
            f"{why}, and none is idle long enough to be forgotten; end finished sessions (session.end), or retry "
            "after the hinted delay",
            reason=Reason.SESSIONS_FULL,
            retry_after_s=self.limits.retry_after_s,
        )

    def _expire(self) -> None:
        """Forget sessions unused for ttl_s (the oldest come first; running ones are skipped)."""
        cutoff = self.clock() - self.limits.ttl_s
        for session in list(self._sessions.values()):
            if session.used > cutoff:
                break
            if session.running is None:
                self._forget(session, "ttl")

    def _evict_idle(self, keep: Session | None = None) -> bool:
        """Forget the least recently used session idle at least min_idle_s; False when none is."""
        cutoff = self.clock() - self.limits.min_idle_s
        for session in self._sessions.values():
            if session.used > cutoff:
                return False
            if session.running is None and session is not keep:
                self._forget(session, "lru")
                return True
        return False

    def _forget(self, session: Session, cause: str) -> None:
        if self._sessions.pop(session.key, None) is None:
            return
        self.tokens -= len(session.tokens)
        caller = session.key[0]
        self._per_client[caller] -= 1
        if not self._per_client[caller]:
            del self._per_client[caller]
        if cause:
            self.metrics.evictions.labels(cause).inc()
        self.metrics.active.set(len(self._sessions))


class Turn:
    """One running turn: `commit` appends it to its session; `refuse` or `close` (always
    called, e.g. by `with`) releases its reservation and, uncommitted, leaves the session as
    it was. A turn is counted once: completed, refused or failed."""

    def __init__(self, store: SessionStore, session: Session, reserved: int) -> None:
        self.store, self.session, self.reserved = store, session, reserved
        self.done = False
        self.committed = False
        self.output: list[int] = []
        """The model's tokens of this turn so far (its caller collects them)."""

    @property
    def history(self) -> list[int]:
        return self.session.tokens

    def apply_version(self, adapter: pb.AdapterRef) -> None:
        """The session's version policy on this turn's adapter: the first turn sets it (follow,
        or pinned to the version it resolves); a later turn asking "newest" (version 0) of a
        pinned session gets the pinned version; one that follows resolves the newest each turn."""
        session = self.session
        if session.turns == 0:
            session.adapter, session.follow = adapter.name, adapter.follow
        elif adapter.name and not adapter.version and not adapter.follow and session.version:
            adapter.version = session.version

    def commit(self, prompt_ids: list[int], output_ids: list[int], *, replica: str = "", version: int = 0) -> None:
        """The turn completed: the model saw `prompt_ids` (the whole history plus this turn's
        new tokens) and answered `output_ids`; they become the session's history."""
        session, store = self.session, self.store
        self._release()
        store.tokens += len(prompt_ids) + len(output_ids) - len(session.tokens)
        session.tokens = [*prompt_ids, *output_ids]
        session.turns += 1
        session.replica = replica or session.replica
        if not session.follow and version:
            session.version = version
        store.metrics.turns.labels("completed").inc()
        self.done = self.committed = True

    def refuse(self) -> None:
        """The turn is refused before any work, once its whole prompt is known (the engine
        cannot serve history + new tokens): counted as refused, like a session bound."""
        self._abandon("refused")

    def close(self, end: bool = False) -> None:
        """End the turn: an uncommitted one counts as failed; `end` forgets the session after a
        committed turn only (a failed or refused last turn can be sent again)."""
        if not self.done:
            self._abandon("failed")
        elif end and self.committed:
            self.store._forget(self.session, "ended")

    def _abandon(self, outcome: str) -> None:
        """Release, count, and forget a session that never completed a turn."""
        if self.done:
            return
        self._release()
        self.store.metrics.turns.labels(outcome).inc()
        self.done = True
        if self.session.turns == 0:
            self.store._forget(self.session, "")

    def _release(self) -> None:
        if self.session.running is self:
            self.session.running = None
            self.session.used = self.store.clock()
            if self.session.key in self.store._sessions:
                self.store._sessions.move_to_end(self.session.key)
            self.store.tokens -= self.reserved
            self.reserved = 0
