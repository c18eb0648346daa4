"""The door's connections: admitted, counted and timed before uvicorn parses a byte of them.

The door shares the proxy's process, so its file descriptors: a caller that could hold
connections without limit would starve the gRPC server of descriptors (audit A4).

Invariants:
- the door holds at most `limit` connections (http.max_connections, and never more than a
  quarter of the soft RLIMIT_NOFILE read at start);
- at the limit a connection still reaches the door: it takes the place of an idle one (that
  has not sent a request's headers yet, a fresh one before one that was served) of the peer
  that holds the most, when that peer holds more than the newcomer's peer would with it;
  else, while some connection is idle, it waits for room for at most `header_timeout_s`
  (MAX_WAITING such at once; beyond, it is closed); while none is, nothing is accepted and
  new connections wait in the kernel's backlog, holding no descriptor of the proxy's. So a
  flood of idle or slow-header connections from a few addresses shares the door with every
  other address instead of taking it (audit 2026-12-07, issue 51), and a peer alone (a TRL
  worker at the limit) waits for its own connections as before;
- one peer IP holds at most `per_peer` of them; one more is closed as soon as it is accepted;
- a connection has `header_timeout_s` to send a request's complete headers (a TLS handshake
  included), from its opening or from the end of its previous response; then it is closed;
- a response sent before its request's body was read (a refusal) closes the connection
  LINGER_S later, whatever the caller still sends;
- each slot is released exactly once, when its connection is lost or fails to open;
- accept errors and refused connections are logged at most once a second (Throttled).
"""

from __future__ import annotations

import asyncio
import errno
import resource
import socket
import ssl
from collections import Counter
from collections.abc import Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from rollwire.runtime.logs import Throttled, get_logger

log = get_logger(__name__)
NOFILE_SHARE = 4
"""The door takes at most 1/NOFILE_SHARE of the process's soft file-descriptor limit."""
LINGER_S = 1.0
"""How long a connection refused before its body was read still drains what arrives, so the caller reads its answer
(closing at once with unread bytes would reset the connection before the answer reaches it)."""
RESOURCE_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


def connection_limit(configured: int) -> tuple[int, int]:
    """(the door's connection limit, the soft RLIMIT_NOFILE it was derived from; 0 = unlimited)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return configured, 0
    return max(1, min(configured, soft // NOFILE_SHARE)), soft


MAX_WAITING = 64
"""Accepted connections that may wait for room at once (each holds a descriptor while it waits)."""


class Slot:
    """One admitted connection's place in the counts; released once. Its protocol says when it
    is idle (waiting for a request's headers) and how to close it (`evict`)."""

    def __init__(self, gate: Gate, peer: str) -> None:
        self.gate, self.peer, self.held = gate, peer, True
        self.idle = True
        self.served = False
        """A response was sent on it: a keep-alive connection, evicted after fresh ones."""
        self.evict: Callable[[], None] = lambda: None

    def release(self) -> None:
        if self.held:
            self.held = False
            self.gate.release(self)


class Gate:
    """Counts of open connections, in total and per peer IP, and who gives way at the limit."""

    def __init__(self, limit: int, per_peer: int) -> None:
        self.limit, self.per_peer = limit, per_peer
        self.open = 0
        self.by_peer: Counter[str] = Counter()
        self.slots: dict[str, dict[Slot, None]] = {}
        """Each peer's slots, oldest first."""
        self.evicted = 0
        self._freed = asyncio.Event()

    def full(self) -> bool:
        return self.open >= self.limit

    def any_idle(self) -> bool:
        return any(slot.idle for slots in self.slots.values() for slot in slots)

    async def wait_room(self) -> None:
        while self.full():
            self._freed.clear()
            await self._freed.wait()

    def admit(self, peer: str) -> Slot | None:
        """A slot for one more connection of `peer`, None when the peer holds its share, or when
        the door is full and no peer holding more has an idle connection to give way (`victim`)."""
        if self.by_peer[peer] >= self.per_peer:
            return None
        if self.full():
            victim = self.victim(peer)
            if victim is None:
                return None
            victim.release()  # counted free now; its connection_lost releases nothing more
            victim.evict()
            self.evicted += 1
        self.open += 1
        self.by_peer[peer] += 1
        slot = Slot(self, peer)
        self.slots.setdefault(peer, {})[slot] = None
        return slot

    def victim(self, peer: str) -> Slot | None:
        """The connection that gives way to one more of `peer`'s: an idle one (never served
        first, oldest first) of the peer holding the most, among those that hold more than
        `peer` would with it; None when there is none."""
        mine = self.by_peer[peer] + 1
        for other, count in self.by_peer.most_common():
            if count <= mine:
                return None
            idle = [slot for slot in self.slots.get(other, {}) if slot.idle]
            if idle:
                return min(idle, key=lambda slot: slot.served)  # stable: the oldest of the fresh, else of the served
        return None

    def release(self, slot: Slot) -> None:
        peer = slot.peer
        self.open -= 1
        self.by_peer[peer] -= 1
        self.slots.get(peer, {}).pop(slot, None)
        if self.by_peer[peer] <= 0:
            del self.by_peer[peer]
            self.slots.pop(peer, None)
        self._freed.set()


class DoorProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline on each request's headers and its slot
    released when the connection ends."""

    def __init__(self, *args, slot: Slot, header_timeout_s: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.slot, self.header_timeout_s = slot, header_timeout_s
        self._header_timer: asyncio.TimerHandle | None = None
        self._timed: object = None
        """The cycle that was current when the header timer was armed: a new one means the headers arrived."""

    def connection_made(self, transport) -> None:  # pyright: ignore[reportIncompatibleMethodOverride]
        super().connection_made(transport)
        self.slot.evict = transport.close
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        try:
            super().connection_lost(exc)
        finally:
            self.slot.release()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._headers_seen()

    def on_response_complete(self) -> None:
        self.slot.served = True
        self._arm()
        super().on_response_complete()
        self._headers_seen()
        if not self.transport.is_closing() and self.conn.their_state not in (h11.DONE, h11.IDLE):
            self.loop.call_later(LINGER_S, self.transport.close)  # answered before the body was read

    def _arm(self) -> None:
        self._disarm()
        self._timed = self.cycle
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)
        self.slot.idle = True  # waiting for a request's headers: it may give way at the limit

    def _disarm(self) -> None:
        self.slot.idle = False
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_seen(self) -> None:
        if self._header_timer is not None and self.cycle is not self._timed:
            self._disarm()

    def _headers_late(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()


class Acceptor:
    """Accepts the door's connections on its listening socket, within the Gate's counts, and
    hands each to a DoorProtocol from `factory(slot)`."""

    def __init__(
        self,
        sock: socket.socket,
        gate: Gate,
        factory: Callable[[Slot], asyncio.Protocol],
        tls: ssl.SSLContext | None,
        handshake_timeout_s: float,
    ) -> None:
        self.sock, self.gate, self.factory = sock, gate, factory
        self.tls, self.handshake_timeout_s = tls, handshake_timeout_s
        self._opening: set[asyncio.Task] = set()
        self._waiting = 0
        self._accept_failed = Throttled(log, "http_accept_failed")
        self._refused = Throttled(log, "http_connection_refused")

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self.sock.setblocking(False)
        while True:
            if self.gate.full() and not self.gate.any_idle():
                await self.gate.wait_room()  # nothing can give way: the kernel's backlog holds them
            try:
                conn, addr = await loop.sock_accept(self.sock)
            except OSError as exc:
                self._accept_failed(error=str(exc), open=self.gate.open)
                await asyncio.sleep(0.5 if exc.errno in RESOURCE_ERRNOS else 0.05)
                continue
            peer = str(addr[0]) if isinstance(addr, tuple) and addr else "unknown"
            if self.gate.by_peer[peer] >= self.gate.per_peer:
                conn.close()
                self._refused(level="info", peer=peer, why="per-peer limit", limit=self.gate.per_peer)
                continue
            slot = self.gate.admit(peer)
            if slot is not None:
                self._start(self._open(loop, conn, slot))
            elif self._waiting < MAX_WAITING:
                self._waiting += 1  # counted now: the accepts before its task runs see it
                self._start(self._wait(loop, conn, peer))
            else:
                conn.close()
                self._refused(level="info", peer=peer, why="door full", limit=self.gate.limit)

    def _start(self, work) -> None:
        task = asyncio.create_task(work)
        self._opening.add(task)
        task.add_done_callback(self._opening.discard)

    async def _wait(self, loop: asyncio.AbstractEventLoop, conn: socket.socket, peer: str) -> None:
        """A connection the full door had no place for: admitted once one frees (within the header deadline)."""
        try:
            async with asyncio.timeout(self.handshake_timeout_s):
                while (slot := self.gate.admit(peer)) is None:
                    if self.gate.by_peer[peer] >= self.gate.per_peer:
                        raise TimeoutError  # its peer filled its share meanwhile
                    await self.gate.wait_room()
        except (TimeoutError, asyncio.CancelledError):
            conn.close()
            self._refused(level="info", peer=peer, why="door full", limit=self.gate.limit)
            return
        finally:
            self._waiting -= 1
        await self._open(loop, conn, slot)

    async def _open(self, loop: asyncio.AbstractEventLoop, conn: socket.socket, slot: Slot) -> None:
        """Hand `conn` to a protocol; a TLS handshake must end within the header deadline."""
        try:
            conn.setblocking(False)  # TCP_NODELAY is inherited from the listening socket
            await loop.connect_accepted_socket(
                lambda: self.factory(slot),
                conn,
                ssl=self.tls,
                ssl_handshake_timeout=self.handshake_timeout_s if self.tls else None,
            )
        except (OSError, ssl.SSLError, TimeoutError, asyncio.CancelledError):
            conn.close()
            slot.release()

    async def stop(self) -> None:
        for task in list(self._opening):
            task.cancel()
        await asyncio.gather(*self._opening, return_exceptions=True)
