"""How one SDK call survives a proxy that dies, restarts or goes silent: which address each
attempt goes to, how long it waits first, and when a broken Generate stream starts again.
Shared by the sync and the asyncio client, which only do the I/O.

Invariants:
- every attempt of a call runs inside the call's one deadline; the last error is raised
  (naming the address it came from) as soon as the next wait would not fit in it;
- an attempt is redone only after UNAVAILABLE: before any response (nothing ran for the
  caller; a push of the same version and digest is idempotent by the wire contract), or, for
  Generate alone, after responses when the connection itself broke — UNAVAILABLE with no
  server reason ("Stream removed", "Socket closed", a keepalive ping timeout). A status a
  server decided after responses is final;
- a server-decided UNAVAILABLE (it carries a reason) cost the fleet work: its retries draw on
  the client's `RetryBudget` (a token bucket shared by all its calls), and after the proxy's
  ATTEMPTS_EXHAUSTED or NO_REPLICA (retries.FLEET_FAULTS) a call tries once more at most, so
  the SDK never multiplies the proxy's own attempts. A connection failure (no reason) reached
  no server and is bounded by the deadline alone;
- a Generate stream started again is announced with `Restarted` before its new `Started`,
  exactly like a proxy restarting a group, so callers handle one case (GroupAccumulator);
- calls take the addresses in turn (round robin); an address whose connection failed goes
  to the back for a while (DOWN_MIN_S, doubling to DOWN_MAX_S while it keeps failing).
  Within one round a call tries every address once without waiting — a dead proxy costs one
  fast refusal, a partitioned one at most the connect timeout (keepalive.timeout_s); after a
  round without success the call backs off (jittered, exponential, at least the server's
  retry hint) and starts another round.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence

import grpc

from rollwire.client._channels import check_target
from rollwire.client._results import Restarted
from rollwire.client._retries import HTTP1_SERVER, Deadline, RetryPolicy, is_retryable
from rollwire.common.errors import RequestError, RollwireError
from rollwire.common.retries import FLEET_FAULTS

DOWN_MIN_S = 1.0
"""How long an address whose connection just failed is tried last."""
DOWN_MAX_S = 30.0
"""The longest an address that keeps failing is tried last (it is still tried when all are)."""
SCHEMES = ("dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:", "vsock:", "xds:")
"""gRPC target schemes: such a target is one name gRPC resolves (and may balance) itself."""


def parse_targets(target: str | Sequence[str]) -> tuple[str, ...]:
    """The addresses a client spreads its calls over.

    "host:port" -> one; "a:1,b:2" or ["a:1", "b:2"] -> several (each its own channel, picked
    by the SDK); "dns:///name:port" -> one channel that gRPC balances round robin over every
    address the name resolves to (any gRPC scheme is kept whole)."""
    if isinstance(target, str):
        if target.strip().startswith(SCHEMES):
            parts = [target.strip()]
        else:
            parts = [p.strip() for p in target.split(",")]
    elif isinstance(target, Sequence) and all(isinstance(t, str) for t in target):
        parts = [t.strip() for t in target]
    else:
        raise RequestError(f"target must be 'host:port', 'a:1,b:2', a list of them or dns:///name:port; got {target!r}")
    parts = [check_target(p) for p in parts if p]
    if not parts:
        raise RequestError(f"target must name at least one address like host:port, got {target!r}")
    return tuple(dict.fromkeys(parts))


def connection_failed(error: RollwireError) -> bool:
    """The connection failed, not the server: UNAVAILABLE carrying no server reason (every
    rollwire server names one; gRPC's own "failed to connect", "Stream removed", "Socket
    closed" and keepalive's "ping timeout" carry none)."""
    return error.code == grpc.StatusCode.UNAVAILABLE and not error.reason


class Rotation:
    """The client's view of its addresses: whose turn it is, and which failed lately.
    Thread-safe: the sync client is shared by threads."""

    def __init__(self, targets: Sequence[str], clock: Callable[[], float] = time.monotonic) -> None:
        self.targets = tuple(targets)
        self._clock = clock
        self._lock = threading.Lock()
        self._next = 0
        self._down_until = [0.0] * len(self.targets)
        self._failures = [0] * len(self.targets)

    def order(self) -> list[int]:
        """Every address once, for one round of a call: from the next in turn, those that
        failed lately last (the one back soonest first)."""
        with self._lock:
            n, start = len(self.targets), self._next
            self._next = (start + 1) % n
            ring = [(start + i) % n for i in range(n)]
            now = self._clock()
            up = [i for i in ring if self._down_until[i] <= now]
            down = sorted((i for i in ring if self._down_until[i] > now), key=self._down_until.__getitem__)
            return up + down

    def failed(self, index: int) -> None:
        with self._lock:
            self._failures[index] += 1
            pause = min(DOWN_MAX_S, DOWN_MIN_S * 2 ** (self._failures[index] - 1))
            self._down_until[index] = self._clock() + pause

    def succeeded(self, index: int) -> None:
        with self._lock:
            self._failures[index], self._down_until[index] = 0, 0.0


class RetryBudget:
    """gRPC's retry throttling for one client: every server-decided failure takes a token,
    every answered attempt gives back `ratio`; such failures are retried only while more than
    half of `max_tokens` is left. Thread-safe: the sync client is shared by threads."""

    def __init__(self, max_tokens: float = 10.0, ratio: float = 0.1) -> None:
        self.max_tokens, self.ratio, self.tokens = max_tokens, ratio, max_tokens
        self._lock = threading.Lock()

    def failed(self) -> bool:
        """A server-decided failure: True while a retry is still within the budget."""
        with self._lock:
            self.tokens = max(0.0, self.tokens - 1)
            return self.tokens > self.max_tokens / 2

    def succeeded(self) -> None:
        with self._lock:
            self.tokens = min(self.max_tokens, self.tokens + self.ratio)


class CallAttempts:
    """The attempts of one call: `index` is the address of the current one; `next` moves on."""

    def __init__(
        self,
        rotation: Rotation,
        policy: RetryPolicy,
        deadline: Deadline,
        rand: Callable[[], float] = random.random,
        budget: RetryBudget | None = None,
    ) -> None:
        self.rotation, self.policy, self.deadline, self._rand = rotation, policy, deadline, rand
        self.budget = budget or RetryBudget()
        self.fleet_faults = 0
        """Attempts that ended with the proxy's ATTEMPTS_EXHAUSTED or NO_REPLICA."""
        self.attempt = 1
        self.rounds = 1
        self._round = rotation.order()
        self.index = self._round.pop(0)
        self.started = time.monotonic()
        self.received = False
        """A response of the current attempt has arrived."""

    @property
    def target(self) -> str:
        return self.rotation.targets[self.index]

    def succeeded(self) -> None:
        """The current address answered (a response arrived): it is not down."""
        self.rotation.succeeded(self.index)

    def responded(self) -> None:
        """A response of the current attempt arrived (the first one proves its address alive)."""
        if not self.received:
            self.received = True
            self.succeeded()
            self.budget.succeeded()

    def retry(self, error: RollwireError, restartable: bool = False) -> tuple[float, Restarted | None]:
        """After the current attempt failed with `error`: the seconds to wait before the next
        one, and the `Restarted` to announce first when a stream had responses (`next`);
        raises `final(error)` when `error` ends the call."""
        received, self.received = self.received, False
        delay = self.next(error, received, restartable)
        if delay is None:
            raise self.final(error)
        return delay, self.restarted(error) if received else None

    def next(self, error: RollwireError, received: bool, restartable: bool = False) -> float | None:
        """After the current attempt failed with `error` (`received`: some response had
        arrived), move to the next attempt; returns the seconds to wait before it, or None
        when `error` is final. `restartable`: the call may start over after responses
        (Generate, announced with Restarted)."""
        broken = connection_failed(error)
        if broken:
            self.rotation.failed(self.index)
        if received and not (restartable and broken):
            return None
        if not received and not is_retryable(error, False):
            return None
        if not received and error.reason:  # a server decided it: the fleet did work for this attempt
            within_budget = self.budget.failed()
            self.fleet_faults += error.reason in FLEET_FAULTS
            if not within_budget or self.fleet_faults > 1:
                return None
        if self.policy.max_attempts is not None and self.attempt >= self.policy.max_attempts:
            return None
        if self._round:
            delay = 0.0  # another address has not been tried in this round: no reason to wait
        else:
            self._round = self.rotation.order()
            delay = self.policy.backoff_s(self.rounds, error.retry_after_s, rand=self._rand)
            self.rounds += 1
        if delay >= self.deadline.remaining():
            return None
        self.index = self._round.pop(0)
        self.attempt += 1
        return delay

    def restarted(self, error: RollwireError) -> Restarted:
        """The event announcing that the group starts over (attempt: the new attempt's number)."""
        return Restarted(
            self.attempt,
            f"the connection broke mid-stream ({error.message}); the client starts the group again on "
            f"{self.target}: discard the partial samples",
        )

    def final(self, error: RollwireError) -> RollwireError:
        """`error`, raised to the caller; when gRPC itself produced it (no server reason) the
        sentence names the address, the attempts and the time they took."""
        if error.reason:
            return error
        spent = time.monotonic() - self.started
        where = self.target + (f" (of {', '.join(self.rotation.targets)})" if len(self.rotation.targets) > 1 else "")
        message = f"{error.message} — from {where}, after {self.attempt} attempt(s) in {spent:.1f}s"
        if error.code == grpc.StatusCode.DEADLINE_EXCEEDED:
            message += "; the call's deadline passed: give a longer timeout or check that the server is reachable"
        elif error.code == grpc.StatusCode.UNAVAILABLE and HTTP1_SERVER in error.message:
            message += "; this is an HTTP port (it answers HTTP/1): use the gRPC port (a proxy's or generator's `port`)"
        elif error.code == grpc.StatusCode.UNAVAILABLE:
            message += "; the server is down or unreachable: check the address and that it is running"
        return type(error)(message, code=error.code, retry_after_s=error.retry_after_s)
