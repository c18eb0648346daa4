"""The bulk path of a push, the sender's half and what both halves agree on.

A push's gRPC stream stays its control plane (manifest, grants, outcome, commit); its bytes
may travel over a plain TCP connection of their own, the receiver's bulk endpoint, where a
hop costs a few large reads instead of gRPC's thousands of small ones. The agreement:

1. the sender's opening sets `bulk` (PushAdapterRequest.bulk);
2. a receiver with a bulk endpoint answers in its initial metadata (`BULK_KEY`: "PORT
   SECRET_HEX"), after it admitted the manifest: a secret made for this push alone, sent
   over the authenticated (and, where configured, encrypted) gRPC stream;
3. the sender connects to PORT on the host it dialled (TLS when its gRPC link uses TLS),
   sends `MAGIC` and `token(secret, manifest, stripe)`, waits for the receiver's `ACK` (it
   took the connection for this push), then sends exactly the bytes it would have chunked (the
   whole payload, or its stripe's chunks in order), then ends its gRPC stream with no chunk.
   A connection the receiver does not take (it came after the offer was withdrawn, or past
   `bulk.max_connections`) is closed before any ACK: the sender sends chunks instead.

Invariants: a token is an HMAC of the receiver's secret over the manifest's name, version and
sha256 and the stripe, so it opens only the push it was issued for; the receiver accepts it
once and only before its expiry. Without an offer, or when the connection fails, the sender
sends chunks on the gRPC stream as it always did (the fallback), and says so.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import ssl
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from rollwire.common.writer import chunks, opening
from rollwire.v1 import generator_pb2 as pb

BULK_KEY = "x-rollwire-bulk"
"""Initial metadata of a receiver that offers its bulk endpoint for this push: "PORT SECRET_HEX"."""
MAGIC = b"RWB2"
"""The first bytes on a bulk connection, before the token."""
ACK = b"\x06"
"""The receiver's one byte on a bulk connection it took for its push; a sender sends no payload byte before it."""
TOKEN_BYTES = 32
HELLO_BYTES = len(MAGIC) + TOKEN_BYTES
SEND_BYTES = 4 << 20
"""Largest piece handed to one sendall (a bigger view is sent in pieces of this size)."""
SEND_TIMEOUT_S = 30.0
"""A blocking sender's deadline per sendall once connected: as long as a receiver waits on a silent
sender (its push idle deadline, 30 s by default), since a receiver may pause for its own children's
bulk connections and buffers before it reads on."""


@dataclass(frozen=True)
class Offer:
    """A receiver's bulk endpoint for one push."""

    port: int
    secret: bytes

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((BULK_KEY, f"{self.port} {self.secret.hex()}"),)


def parse_offer(metadata: Sequence[tuple[str, str | bytes]] | None) -> Offer | None:
    """The offer in a receiver's initial metadata, or None (no offer, or one that does not parse)."""
    value = next((v for k, v in metadata or () if k == BULK_KEY), None)
    if not isinstance(value, str):
        return None
    port, _, secret = value.partition(" ")
    try:
        offer = Offer(int(port), bytes.fromhex(secret))
    except ValueError:
        return None
    return offer if 0 < offer.port < 65536 and len(offer.secret) >= 16 else None


def token(secret: bytes, manifest: pb.AdapterManifest, stripe: pb.Stripe | None) -> bytes:
    """The one-time token that binds a bulk connection to this push (and stripe)."""
    index = f"{stripe.index}/{stripe.count}/{stripe.chunk_bytes}" if stripe is not None else "-"
    text = f"rollwire-bulk\0{manifest.name}\0{manifest.version}\0{manifest.sha256}\0{index}"
    return hmac.new(secret, text.encode(), hashlib.sha256).digest()


def connect(
    host: str,
    offer: Offer,
    proof: bytes,
    timeout: float,
    tls: ssl.SSLContext | None = None,
    server_name: str | None = None,
) -> socket.socket:
    """A bulk connection to `host` (blocking: call it off the event loop), with its hello sent.
    Every later send has `timeout` as its deadline. Raises OSError (ssl.SSLError included)."""
    sock = socket.create_connection((host.strip("[]"), offer.port), timeout=timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls is not None:
            sock = tls.wrap_socket(sock, server_hostname=server_name or host.strip("[]"))
        sock.sendall(MAGIC + proof)
        if _recv_byte(sock) != ACK:  # closed unacknowledged: not taken (late, or too many connections)
            raise ConnectionRefusedError("the receiver did not take this bulk connection")
    except BaseException:
        sock.close()
        raise
    return sock


def _recv_byte(sock: socket.socket) -> bytes:
    try:
        return sock.recv(1)
    except ConnectionResetError:
        return b""


def acknowledge(sock: socket.socket) -> None:
    """The receiver's side: this connection is taken for its push (blocking: off the event loop)."""
    sock.sendall(ACK)


def send(sock: socket.socket, data: bytes | bytearray | memoryview) -> None:
    """All of `data` (blocking), in pieces of at most SEND_BYTES, without copying it."""
    view = memoryview(data).cast("B")
    for start in range(0, len(view), SEND_BYTES):
        sock.sendall(view[start : start + SEND_BYTES])


def close(sock: socket.socket) -> None:
    """End the sender's side, wait (within the socket's timeout) for the receiver, which closes
    once it read the count it expects, then release it: closing with bytes unread (a TLS
    session ticket, say) would reset the connection and drop the receiver's last bytes."""
    try:
        sock.shutdown(socket.SHUT_WR)
        while sock.recv(1 << 16):
            pass
    except OSError:
        pass
    sock.close()


class BlockingPush:
    """A blocking sender's push that asks for the bulk path (the sync SDK's): `requests()` is the
    stream gRPC consumes on its own thread; once `attach`ed to the call, it reads the offer,
    sends the bytes over the bulk connection and ends the stream, or falls back to chunks.
    `path` and `reason` say what happened."""

    def __init__(
        self,
        manifest: pb.AdapterManifest,
        payload: bytes,
        chunk_bytes: int,
        host: str,
        connect_timeout: float,
        tls: ssl.SSLContext | None = None,
        server_name: str | None = None,
    ) -> None:
        self.manifest, self.payload, self.chunk_bytes = manifest, payload, chunk_bytes
        self.host, self.connect_timeout, self.tls, self.server_name = host, connect_timeout, tls, server_name
        self._call: Any = None
        self._attached = threading.Event()
        self.path, self.reason = "grpc", "no_offer"

    def attach(self, call: Any) -> None:
        self._call = call
        self._attached.set()

    def requests(self) -> Iterator[pb.PushAdapterRequest]:
        yield opening(self.manifest, bulk=True)
        sock = self._connect()
        if sock is not None:
            sock.settimeout(max(self.connect_timeout, SEND_TIMEOUT_S))
            try:
                send(sock, self.payload)
            finally:
                close(sock)
            self.path, self.reason = "bulk", "connected"
            return
        for piece in chunks(self.payload, self.chunk_bytes):
            yield pb.PushAdapterRequest(chunk=piece)

    def _connect(self) -> socket.socket | None:
        """The bulk connection, or None (no offer within the connect timeout, or a failed connection)."""
        if not self._attached.wait(self.connect_timeout):
            return None
        got: list = []
        reader = threading.Thread(target=lambda: got.append(self._call.initial_metadata()), daemon=True)
        reader.start()
        reader.join(self.connect_timeout)  # a receiver that never answers the ask gets chunks
        offer = parse_offer(got[0]) if got else None
        if offer is None:
            self.reason = "no_offer" if got else "timeout"
            return None
        try:
            return connect(
                self.host,
                offer,
                token(offer.secret, self.manifest, None),
                self.connect_timeout,
                self.tls,
                self.server_name,
            )
        except ssl.SSLError:
            self.reason = "tls"
        except TimeoutError:
            self.reason = "timeout"
        except ConnectionRefusedError:
            self.reason = "refused"
        except OSError:
            self.reason = "unreachable"
        return None
