"""The bulk path of a push on the servers: the receiver's listener and reads, the sender's lanes.

What both halves agree on (the offer, the token, the hello) is `rollwire.common.bulk`, which
the SDK shares. Here:

- `BulkListener`: a receiver's TCP listener (TLS with the server's own certificates when its
  gRPC port uses TLS). `expect` issues an offer for one admitted push (offers.py keeps them); a
  connection whose hello carries that push's token is handed to it, once, before the offer
  expires; any other connection is closed. Accepting and the hello run on threads. A connection that has not
  proved a token yet holds one of `bulk.max_connections` hello places (one peer address at
  most HELLO_PEER_SHARE of them) for `connect_timeout_s` in all, however it trickles; a
  newcomer past its peer's share displaces that peer's oldest unproven connection, and past
  every place the oldest of all, so connections without a token never take a push's
  connection's place (audit S12). A proved connection holds one of `bulk.max_connections`
  push places of its own; past them it is closed before its ACK (the sender falls back).
- `BulkSource`: the receiver's reads of one push: exact-size pieces (`recv_into` their place in
  one buffer of the push's bytes, a few pieces read ahead on one thread), each with the push's
  idle deadline.
- `BulkDial` / `BulkLane`: a sender's side of one child: the offer read from the child's
  initial metadata, the connection made off the event loop within `connect_timeout_s`, each
  chunk sent by `sendall` of the very buffer received (no copy), each with a deadline. No
  offer or a failed connection returns no lane: the caller sends gRPC chunks (the fallback),
  logged and counted (`path`).
"""

from __future__ import annotations

import asyncio
import mmap
import secrets
import socket
import ssl
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from rollwire.common import bulk as wire
from rollwire.common.addresses import split_address
from rollwire.common.errors import DeadlineExceeded, InvalidArgument
from rollwire.common.reasons import Reason
from rollwire.push.buffers import BufferPool, payload_buffer
from rollwire.push.offers import Accepted, Expected, Offers
from rollwire.runtime.dialing import DialSection
from rollwire.runtime.logs import get_logger
from rollwire.runtime.security import TlsSection
from rollwire.serving.config import BulkSection
from rollwire.v1 import generator_pb2 as pb

log = get_logger(__name__)
HELLO_PEER_SHARE = 0.125
"""The share of a listener's hello places one peer address may hold at once."""
READ_AHEAD = 4
"""Pieces a receiver reads ahead of the event loop (each at most 1 MiB, or a stripe's chunk)."""

PathCounter = Callable[[str, str], None]
"""Counts one push hop by (path: "bulk" or "grpc", reason)."""


def server_tls(tls: TlsSection) -> ssl.SSLContext | None:
    """The bulk listener's TLS: the gRPC server's certificate and key, its client CA (mutual TLS) when set."""
    if not tls.cert_file:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.num_tickets = 0  # nothing the sender would leave unread (see common.bulk.close)
    context.load_cert_chain(tls.cert_file, tls.key_file)
    if tls.client_ca_file:
        context.load_verify_locations(tls.client_ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_tls(root: str, cert: str = "", key: str = "") -> ssl.SSLContext:
    """A sender's TLS to bulk listeners: the CA file its gRPC link trusts (empty: the system's), its client
    certificate when it has one (mutual TLS)."""
    context = ssl.create_default_context(cafile=root or None)
    if cert:
        context.load_cert_chain(cert, key or None)
    return context


@dataclass(eq=False)
class _Unproven:
    """A connection in its hello: its socket (TLS-wrapped once its handshake began) and peer."""

    sock: socket.socket
    peer: str


class BulkListener:
    """A receiver's bulk endpoint (see the module's docstring). `close()` at shutdown."""

    def __init__(self, host: str, section: BulkSection, tls: TlsSection) -> None:
        self.section, self.tls = section, server_tls(tls)
        self.sock = socket.create_server((host.strip("[]"), section.port), backlog=128)
        self.port: int = self.sock.getsockname()[1]
        self.pool = BufferPool(section.reuse_bytes)
        """The buffers its pushes are received into, reused across pushes of the same size."""
        self.offers = Offers(section.connect_timeout_s)
        self._lock = threading.Lock()
        self._open = threading.BoundedSemaphore(section.max_connections)
        """Places of proved connections (a push's bytes)."""
        self._unproven: dict[_Unproven, None] = {}
        """Connections in their hello, oldest first (at most max_connections)."""
        self._by_peer: Counter[str] = Counter()
        self.peer_share = max(1, int(section.max_connections * HELLO_PEER_SHARE))
        # one thread per hello it may hold, and one for each that was closed for a newcomer while it ends
        self._hellos = ThreadPoolExecutor(max_workers=2 * section.max_connections, thread_name_prefix="bulk-hello")
        self.closed = False
        threading.Thread(target=self._accept, name=f"bulk-accept-{self.port}", daemon=True).start()

    def expect(self, manifest: pb.AdapterManifest, stripe: pb.Stripe | None) -> tuple[wire.Offer, Expected]:
        """A fresh offer for this push, and what waits for its connection (`connection`)."""
        offer = wire.Offer(self.port, secrets.token_bytes(32))
        expected = self.offers.issue(wire.token(offer.secret, manifest, stripe), asyncio.get_running_loop())
        return offer, expected

    async def connection(self, expected: Expected, timeout: float) -> Accepted | None:
        """The connection that proved the offer's token, or None when none came within
        `timeout` (the offer is withdrawn then: a late one is closed)."""
        try:
            async with asyncio.timeout(timeout):
                return await asyncio.shield(expected.conn)
        except TimeoutError:
            return None
        finally:
            self.withdraw(expected)

    def withdraw(self, expected: Expected) -> None:
        """The offer is over (taken, refused, or the push ended): a connection that comes now is closed."""
        self.offers.withdraw(expected)
        if not expected.conn.done():
            expected.conn.cancel()

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, addr = self.sock.accept()
            except OSError:
                return  # closed
            peer = str(addr[0]) if isinstance(addr, tuple) and addr else "unknown"
            self._hellos.submit(self._hello, self._admit(conn, peer))

    def _admit(self, conn: socket.socket, peer: str) -> _Unproven:
        """A hello place for `conn`: its peer's oldest unproven connection is shut for it when
        the peer holds its share, else the oldest of all when every place is taken (its thread
        closes it); so a flood only ever displaces the longest-waiting hellos."""
        with self._lock:
            crowded = self._by_peer[peer] >= self.peer_share
            if crowded or len(self._unproven) >= self.section.max_connections:
                oldest = next(h for h in self._unproven if not crowded or h.peer == peer)
                self._forget(oldest)
                _shut_only(oldest.sock)
            hello = _Unproven(conn, peer)
            self._unproven[hello] = None
            self._by_peer[peer] += 1
            return hello

    def _forget(self, hello: _Unproven) -> None:
        """Its hello place is free (under the lock; idempotent)."""
        if self._unproven.pop(hello, False) is None:
            self._by_peer[hello.peer] -= 1
            if self._by_peer[hello.peer] <= 0:
                del self._by_peer[hello.peer]

    def _hello(self, hello: _Unproven) -> None:
        """Read the hello within the connect timeout, in all, and hand the connection to its
        push (a push place), or close it."""
        conn, placed = hello.sock, False
        deadline = time.monotonic() + self.section.connect_timeout_s
        try:
            conn.settimeout(self.section.connect_timeout_s)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls is not None:
                conn = hello.sock = self.tls.wrap_socket(conn, server_side=True)
            expected = self.offers.claim(_read_exact(conn, wire.HELLO_BYTES, deadline))
            with self._lock:
                self._forget(hello)
            if expected is None:
                raise ConnectionRefusedError("no push expects this token")
            if not self._open.acquire(blocking=False):
                raise ConnectionRefusedError("every push place is taken")
            placed = True
            conn.settimeout(self.section.connect_timeout_s)
            expected.loop.call_soon_threadsafe(_deliver, expected.conn, Accepted(conn, self._open.release))
        except (OSError, EOFError, RuntimeError):
            _shut(conn)
            if placed:
                self._open.release()
        finally:
            with self._lock:
                self._forget(hello)

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self._hellos.shutdown(wait=False, cancel_futures=True)


def _deliver(future: asyncio.Future, accepted: Accepted) -> None:
    """On the push's loop: hand the connection over, or close it when its push stopped waiting."""
    if future.done():
        _shut(accepted.sock)
        accepted.release()
        return
    future.set_result(accepted)


def _shut(conn: socket.socket) -> None:
    _shut_only(conn)
    conn.close()


def _shut_only(conn: socket.socket) -> None:
    """Wake whatever thread reads `conn` (its read ends), leaving the close to that thread."""
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _read_exact(conn: socket.socket, size: int, deadline: float) -> bytearray:
    """Exactly `size` bytes into one preallocated buffer by `deadline` (monotonic), however
    they trickle: TimeoutError past it, EOFError when the sender ends first."""
    buf, got = bytearray(size), 0
    view = memoryview(buf)
    while got < size:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the hello did not arrive in time")
        conn.settimeout(left)
        n = conn.recv_into(view[got:], size - got)
        if n == 0:
            raise EOFError(got)
        got += n
    return buf


def recv_exact(conn: socket.socket, view: memoryview) -> memoryview:
    """Fill `view` from `conn` (recv_into, no copy in user space); EOFError(bytes got) when the
    sender ends first, TimeoutError when a read waits longer than the socket's timeout."""
    size, got = len(view), 0
    while got < size:
        n = conn.recv_into(view[got:], size - got)
        if n == 0:
            raise EOFError(got)
        got += n
    return view


@dataclass(eq=False)
class BulkSource:
    """The receiver's reads of one push's bytes, in pieces of the given sizes, on one thread
    reading up to READ_AHEAD pieces ahead, each straight into its place in one buffer of all
    the bytes expected (`buffer`, allocated by that thread first: buffers.payload_buffer);
    every read has `idle_s` as its deadline."""

    accepted: Accepted
    idle_s: float
    buffer: bytearray | mmap.mmap | None = None
    """Every byte this connection carries, in order, once read (the payload, or a stripe's chunks):
    given (`BufferPool.take`, before the offer), else allocated by the reading thread first; or
    (`run_at`) the payload's buffer a stripe's chunks land in, each in its place."""
    received: int = 0
    _pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="bulk-read")
    )
    _ahead: deque[tuple[int, Future[memoryview]]] = field(default_factory=deque)

    def __post_init__(self) -> None:
        self.conn = self.accepted.sock
        self.conn.settimeout(self.idle_s)

    async def pieces(self, sizes: Sequence[int], total: int):
        """Each piece, in order, as it is complete: a view of its place in `buffer` (`total`: the
        bytes expected in all, which the receiver admitted: the buffer's size)."""
        self._pool.submit(self._allocate, total)  # first on the reading thread: never on the event loop
        offset = 0
        for size in sizes:
            self._ahead.append((size, self._pool.submit(self._read, offset, size)))
            offset += size
            if len(self._ahead) < READ_AHEAD:
                continue
            yield await self._next(total)
        while self._ahead:
            yield await self._next(total)

    def take_buffer(self) -> bytearray | mmap.mmap:
        """The buffer of every byte read, once all were (the payload, kept where it was received)."""
        assert self.buffer is not None, "pieces() first"
        return self.buffer

    def _allocate(self, total: int) -> None:
        if self.buffer is None or len(self.buffer) != total:
            self.buffer = payload_buffer(total)

    def _read(self, offset: int, size: int) -> memoryview:
        assert self.buffer is not None
        return recv_exact(self.conn, memoryview(self.buffer)[offset : offset + size])

    async def _next(self, total: int) -> memoryview:
        size, future = self._ahead.popleft()
        try:
            piece = await asyncio.wrap_future(future)
        except (TimeoutError, EOFError, OSError) as exc:
            raise self.failure(exc, total) from None
        self.received += size
        return piece

    def run(self, sizes: Sequence[int], total: int, on_piece: Callable[[memoryview], None]) -> None:
        """On the reading thread (blocking): every piece read into its place in `buffer`, then
        `on_piece(view)` before the next is read (hash, checks, forwarding: no hand-off per
        piece). Raises what `failure` maps, or what `on_piece` raises; `close` ends it."""
        self._allocate(total)
        offset = 0
        for size in sizes:
            on_piece(self._read(offset, size))
            offset += size
            self.received += size

    def failure(self, exc: BaseException, total: int) -> BaseException:
        """A read's failure as the push's error: a stall (the idle deadline), or a truncated upload."""
        if isinstance(exc, TimeoutError):
            return DeadlineExceeded(
                f"the push's bulk connection sent nothing for {self.idle_s:g} s, so the receiver cancelled it; "
                "push again",
                reason=Reason.PUSH_IDLE,
            )
        if isinstance(exc, (EOFError, OSError)):
            got = self.received + (exc.args[0] if isinstance(exc, EOFError) else 0)
            return InvalidArgument(
                f"the push's bulk connection ended after {got} of the {total} bytes expected "
                f"({type(exc).__name__}); the upload was truncated",
                reason=Reason.LENGTH_MISMATCH,
            )
        return exc

    async def read_all(self, sizes: Sequence[int], total: int, on_piece: Callable[[memoryview], None]) -> None:
        """`run` on the reading thread, its failure raised here (a cancellation closes the connection)."""
        await self._reading(self._pool.submit(self.run, sizes, total, on_piece), total)

    def run_at(self, places: Sequence[tuple[int, int]], on_piece: Callable[[int, memoryview], None]) -> None:
        """As `run`, but each piece k is read into `buffer` at places[k] = (offset, size) (a
        stripe's chunks, each in its place in the payload's buffer, which was given), then
        `on_piece(k, view)`."""
        assert self.buffer is not None, "a buffer to read into first"
        for k, (offset, size) in enumerate(places):
            on_piece(k, self._read(offset, size))
            self.received += size

    async def read_at(self, places: Sequence[tuple[int, int]], on_piece: Callable[[int, memoryview], None]) -> None:
        """`run_at` on the reading thread, its failure raised here (as `read_all`)."""
        total = sum(size for _, size in places)
        await self._reading(self._pool.submit(self.run_at, places, on_piece), total)

    async def _reading(self, reads: Future[None], total: int) -> None:
        try:
            await asyncio.wrap_future(reads)
        except (TimeoutError, EOFError, OSError) as exc:
            raise self.failure(exc, total) from None
        except asyncio.CancelledError:
            self.close()  # a blocked read ends at once
            raise

    def close(self) -> None:
        """Stop reading (a blocked read ends at once) and give the connection's slot back; idempotent."""
        for _, future in self._ahead:
            future.cancel()
        self._ahead.clear()
        _shut(self.conn)
        self.accepted.release()
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass(frozen=True)
class BulkDial:
    """How a sender reaches its children's bulk endpoints."""

    connect_timeout_s: float
    tls: ssl.SSLContext | None = None
    server_name: str = ""
    count: PathCounter = lambda path, reason: None

    @classmethod
    def from_config(cls, section: BulkSection, link: DialSection, count: PathCounter) -> BulkDial | None:
        """None when this server does not ask (`bulk.send` false). `link`: how it dials the
        receivers over gRPC; its TLS (CA, client certificate) is the bulk connection's too."""
        if not section.send:
            return None
        tls = (
            client_tls(link.ca_file, link.cert_file, link.key_file)
            if link.tls or link.ca_file or link.cert_file
            else None
        )
        return cls(section.connect_timeout_s, tls, link.server_name, count)


class BulkLane:
    """One child's bulk connection: `send` each chunk, then `close`."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bulk-send")

    @classmethod
    async def open(
        cls,
        dial: BulkDial,
        call: grpc.aio.StreamUnaryCall,
        address: str,
        manifest: pb.AdapterManifest,
        stripe: pb.Stripe | None,
        send_timeout: float,
    ) -> BulkLane | None:
        """The lane to the child at `address` when it offered one and the connection worked;
        None otherwise (the caller sends gRPC chunks), logged and counted."""
        reason = "no_offer"
        try:
            async with asyncio.timeout(dial.connect_timeout_s):
                offer = wire.parse_offer(await call.initial_metadata())  # pyright: ignore[reportArgumentType]
            if offer is not None:
                host = split_address(address)[0]
                proof = wire.token(offer.secret, manifest, stripe)
                connect = (host, offer, proof, dial.connect_timeout_s, dial.tls, dial.server_name or None)
                async with asyncio.timeout(dial.connect_timeout_s + 1):  # its socket has the timeout too
                    sock = await asyncio.to_thread(wire.connect, *connect)
                sock.settimeout(send_timeout)
                dial.count("bulk", "connected")
                return cls(sock)
        except TimeoutError:
            reason = "timeout"
        except ssl.SSLError:
            reason = "tls"
        except ConnectionRefusedError:
            reason = "refused"
        except (OSError, ValueError, grpc.RpcError):
            reason = "unreachable"
        dial.count("grpc", reason)
        if reason != "no_offer":
            log.warning(
                "push_bulk_fallback", child=address, reason=reason, adapter=manifest.name, version=manifest.version
            )
        return None

    async def send(self, chunk: bytes | bytearray) -> None:
        """All of `chunk`, off the event loop; OSError (a timeout included) when the child stops taking it."""
        await asyncio.get_running_loop().run_in_executor(self.pool, wire.send, self.sock, chunk)

    def close(self) -> None:
        self.pool.submit(wire.close, self.sock)  # after the last send: one worker, in order
        self.pool.shutdown(wait=False)

    def abort(self) -> None:
        _shut(self.sock)
        self.pool.shutdown(wait=False, cancel_futures=True)
