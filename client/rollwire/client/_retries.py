"""When the SDK tries a call again, and how long it waits: the retry predicate, the policy, the deadline.

Invariants:
- the only failure ever retried is UNAVAILABLE before the first response message: nothing
  was generated for the caller yet, and a push of the same version and digest is idempotent;
  the one exception, a Generate stream whose connection broke after its first message, is
  started again and announced with `Restarted`, as a proxy does (_failover.py);
- every attempt of a call shares one deadline, so retries never extend it.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

from rollwire.common.errors import RollwireError
from rollwire.common.errors import whole_number as _int
from rollwire.common.retries import SDK_RETRIES

HTTP1_SERVER = "http1.x server"
"""What gRPC reports when the address answers HTTP/1 (an HTTP port: the proxy's door, a
metrics port): no retry mends it."""


def is_retryable(error: RollwireError, received_response: bool) -> bool:
    """The SDK's one retry predicate: a code in retries.SDK_RETRIES (UNAVAILABLE), and nothing
    received from the server yet (so no work can be duplicated), unless the address speaks
    HTTP/1; the why: rollwire.common.retries."""
    return error.code in SDK_RETRIES and not received_response and HTTP1_SERVER not in error.message


@dataclass(frozen=True)
class RetryPolicy:
    """Attempts with jittered exponential backoff, inside the call's deadline."""

    max_attempts: int | None = None
    """None: as many as the call's deadline allows (a proxy restarting is waited out)."""
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 1.0

    def __post_init__(self) -> None:
        if self.max_attempts is not None:
            _int("max_attempts", self.max_attempts, 1, 10_000)

    def backoff_s(self, attempt: int, hint_s: float | None = None, rand: Any = random.random) -> float:
        """Delay after failed attempt `attempt` (1-based): half to all of the exponential step."""
        step = min(self.max_backoff_s, self.initial_backoff_s * 2 ** (attempt - 1))
        return max(step * (0.5 + 0.5 * rand()), hint_s or 0.0)


class Deadline:
    """One deadline shared by every attempt of a call, so retries never extend it."""

    def __init__(self, timeout_s: float) -> None:
        self._end = time.monotonic() + timeout_s

    def remaining(self) -> float:
        return max(0.0, self._end - time.monotonic())
