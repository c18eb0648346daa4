"""A bulk listener's offers: which push each token opens, until when, and the connection that
proved one. No socket is made here, so the rules are unit-tested (tests/unit/push/test_bulk_offers.py);
the listener that reads hellos is bulk.py's.

Invariants: a hello's token opens its push once (`Offers.claim` removes the offer) and only
before the offer expires; any other hello (wrong magic, an unknown, taken, withdrawn or expired
token) claims nothing.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from rollwire.common import bulk as wire


@dataclass(eq=False)
class Expected:
    """One offer: the connection that proves its token, delivered to the push's event loop."""

    proof: bytes
    loop: asyncio.AbstractEventLoop
    expires: float
    conn: asyncio.Future[Accepted]


class Offers:
    """The offers a listener has issued and not yet seen taken: no socket, so it is unit-tested.

    Invariants: a hello's token opens its push once (`claim` removes the offer) and only before
    the offer expires, `ttl_s` after it was issued (`clock`: time.monotonic); any other hello
    (wrong magic, an unknown, taken, withdrawn or expired token) claims nothing."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s, self.clock = ttl_s, clock
        self._expected: dict[bytes, Expected] = {}
        self._lock = threading.Lock()

    def issue(self, proof: bytes, loop: asyncio.AbstractEventLoop) -> Expected:
        """What waits for the connection that proves `proof` (expired and settled offers are dropped)."""
        expected = Expected(proof, loop, self.clock() + self.ttl_s, loop.create_future())
        with self._lock:
            now = self.clock()
            self._expected = {k: e for k, e in self._expected.items() if e.expires > now and not e.conn.done()}
            self._expected[proof] = expected
        return expected

    def claim(self, hello: bytes | bytearray) -> Expected | None:
        """The offer this hello (MAGIC + token) proves, taken once; None for any other hello."""
        with self._lock:
            expected = self._expected.pop(bytes(hello[len(wire.MAGIC) :]), None)
        if hello[: len(wire.MAGIC)] != wire.MAGIC or expected is None or expected.expires < self.clock():
            return None
        return expected

    def withdraw(self, expected: Expected) -> None:
        """The offer is over: a hello that comes now claims nothing."""
        with self._lock:
            self._expected.pop(expected.proof, None)


class Accepted:
    """A bulk connection that proved its push's token; `release` gives its listener slot back (once)."""

    def __init__(self, sock: socket.socket, release: Callable[[], None]) -> None:
        self.sock, self._release = sock, release

    def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()
