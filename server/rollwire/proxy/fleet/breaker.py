"""Circuit breaker of one replica: ejection on consecutive failures, with recovery.

Closed: traffic flows and consecutive failed attempts are counted. After `threshold` of
them the circuit opens: the replica is ejected for `base_s`, doubled on each consecutive
ejection up to `max_s`. When the time is up it is half-open: it takes traffic again, and
its next attempt decides: a success closes the circuit and forgets the ejections, a
failure ejects it again for longer. Pure: the caller passes the clock.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Breaker:
    threshold: int
    base_s: float
    max_s: float
    failures: int = 0
    ejections: int = 0
    open_until: float = 0.0

    def allows(self, now: float) -> bool:
        """True when the replica may take new work."""
        return now >= self.open_until

    def half_open(self, now: float) -> bool:
        return self.ejections > 0 and now >= self.open_until

    def record_success(self) -> None:
        self.failures = 0
        self.ejections = 0

    def record_failure(self, now: float) -> bool:
        """Count a failed attempt; True when this failure ejects the replica."""
        self.failures += 1
        if self.half_open(now) or self.failures >= self.threshold:
            self.ejections += 1
            self.failures = 0
            self.open_until = now + min(self.max_s, self.base_s * 2 ** (self.ejections - 1))
            return True
        return False
