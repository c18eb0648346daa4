"""How long a silent peer can hold a connection: gRPC keepalive and reconnect timing for every
rollwire channel and server, one set of numbers that both sides import.

A peer that vanishes without closing its connection (a cut link, a frozen or powered-off
host) sends no FIN or RST, so without keepalive a stream waits for TCP's own timeouts
(minutes to hours). With it, each side pings the other once `time_s` has passed without
receiving anything, and closes the connection when the ping is not answered within
`timeout_s`: every call on it then ends with UNAVAILABLE ("ping timeout"). So:

    a client notices a silent server at most `time_s + timeout_s` after the last byte it
    sent (`Keepalive.bound_s`, 10 s by default);

and a server a silent client within `time_s + BULK_PING_TIMEOUT_S`: a server waits longer for
an answer, because on a push its client's answer queues behind the push bytes (see
`Keepalive.server_options`), and it is the client that moves work elsewhere.

Why these numbers: the bound must be well inside the deadlines it protects — the SDK's
default call deadline is 60 s and the learner's 120 s, so a client cut off from a proxy
learns it with most of its deadline left to try another proxy; the proxy's own health checks
(interval 1 s, timeout 2 s, 2 failures) take a hung replica out of rotation in ~5 s, and
keepalive ends its open streams within the same order of time. A ping is 17 bytes, so a 5 s
period costs nothing measurable even with thousands of connections. Keepalive pings only go
out when nothing was received for `time_s`: a stream that carries tokens never pings for
keepalive. (A receiver of data sends gRPC's flow-control probe pings, timed by the same
deadline: hence the longer one of push connections and servers.)

Invariants:
- a server accepts pings as often as every `MIN_PING_INTERVAL_S`, with or without calls, and
  every SDK or proxy channel pings at most that often (`time_s >= MIN_PING_INTERVAL_S` is
  checked), so no rollwire client is ever sent GOAWAY "too_many_pings";
- the ping deadline is set through both `grpc.keepalive_timeout_ms` and
  `grpc.http2.ping_timeout_ms`: gRPC 1.85 times a keepalive ping out by the latter (60 s by
  default), measured here with a SIGSTOPped server;
- `grpc.http2.max_pings_without_data` is 0 (no limit): a client that only waits on a stream
  sends no data, and with the default (2) it would stop pinging after two pings;
- a connection attempt fails after `timeout_s` (a partitioned address answers nothing, not
  even a refusal; gRPC reads that timeout from `grpc.min_reconnect_backoff_ms`, measured:
  `grpc.min_connect_timeout_ms` does nothing) and reconnects start after `RECONNECT_MIN_S`,
  at most `RECONNECT_MAX_S` apart, so a process that comes back at the same address is found
  again within about a second (measured: 0.8 s after a 4 s outage).

Torch- and pydantic-free: the SDK imports it. The servers' config section is
rollwire.serving.keepalive.KeepaliveSection.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MIN_PING_INTERVAL_S = 1.0
"""Shortest ping period a rollwire server accepts, and the shortest a rollwire channel uses."""
RECONNECT_MIN_S = 0.2
"""First wait before dialling again after a connection failed."""
RECONNECT_MAX_S = 1.0
"""Longest wait between two connection attempts (gRPC's default grows to 120 s)."""
MAX_PING_STRIKES = 2
"""Pings below MIN_PING_INTERVAL_S a server tolerates before GOAWAY (gRPC's default)."""
BULK_PING_TIMEOUT_S = 60.0
"""Ping deadline on a connection that carries only adapter pushes (`Dialer.channel(bulk=True)`).
A ping queues behind the push bytes already in that connection's socket buffers, which drain
at its share of the link: eight pushes sharing 50 Mbit/s took longer than `timeout_s` to send
one, and the connection was closed mid-push ("ping timeout"). A dead or stalled receiver of a
push is found by the push itself (the relay's stall rule and the push deadline), not by this."""


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


@dataclass(frozen=True)
class Keepalive:
    """One side's keepalive timing; `bound_s` is how long a silent peer can go unnoticed."""

    time_s: float = 5.0
    """Ping after this long without receiving anything."""
    timeout_s: float = 5.0
    """Close the connection when a ping is not answered within this long."""

    def __post_init__(self) -> None:
        if not MIN_PING_INTERVAL_S <= self.time_s <= 3600:
            raise ValueError(f"keepalive time_s must be in [{MIN_PING_INTERVAL_S:g}, 3600] seconds, got {self.time_s}")
        if not 0.1 <= self.timeout_s <= 600:
            raise ValueError(f"keepalive timeout_s must be in [0.1, 600] seconds, got {self.timeout_s}")

    @property
    def bound_s(self) -> float:
        """Longest time from a peer's last byte to its connection being closed."""
        return self.time_s + self.timeout_s

    def _ping_options(self) -> list[tuple[str, int]]:
        """Both ends alike: ping after `time_s` without receiving anything, close the connection
        when a ping is not answered within `timeout_s`, ping even when no call is open."""
        return [
            ("grpc.keepalive_time_ms", _ms(self.time_s)),
            ("grpc.keepalive_timeout_ms", _ms(self.timeout_s)),
            ("grpc.http2.ping_timeout_ms", _ms(self.timeout_s)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
        ]

    def channel_options(self) -> list[tuple[str, int]]:
        """Options of a client channel (SDK, proxy to replicas and peers, relays, heartbeats)."""
        return [
            *self._ping_options(),
            # despite its name, gRPC uses min_reconnect_backoff_ms as the connect timeout (measured)
            ("grpc.min_reconnect_backoff_ms", _ms(self.timeout_s)),
            ("grpc.initial_reconnect_backoff_ms", _ms(RECONNECT_MIN_S)),
            ("grpc.max_reconnect_backoff_ms", _ms(RECONNECT_MAX_S)),
        ]

    def server_options(self) -> list[tuple[str, int]]:
        """Options of a server: it pings its clients like a channel does (a learner or proxy that
        vanished frees its streams and their replica work), waiting `BULK_PING_TIMEOUT_S` at
        least for an answer, and accepts their pings. Why the longer wait: a server pings a
        client that is sending it data too (gRPC's flow-control probe), and on a push that
        client's answer queues behind the push bytes already in its socket buffers; a server
        cannot tell push connections from others, so all of them get the push deadline. With
        `timeout_s` a 1 Mbit/s uplink lost every gRPC push after 5.8 s (GOAWAY ping_timeout,
        measured). A client still notices a silent server within `bound_s`: that is the side
        that restarts the work elsewhere; a server's own wait only frees what a vanished client
        left behind, now within `time_s + BULK_PING_TIMEOUT_S`."""
        return [
            *for_pushes(self._ping_options()),
            ("grpc.http2.min_ping_interval_without_data_ms", _ms(MIN_PING_INTERVAL_S)),
            ("grpc.http2.max_ping_strikes", MAX_PING_STRIKES),
        ]


DEFAULT = Keepalive()

_PING_DEADLINES = ("grpc.keepalive_timeout_ms", "grpc.http2.ping_timeout_ms")


def for_pushes(options: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """A channel's options for a connection that carries only pushes: the same, with the ping
    deadline raised to BULK_PING_TIMEOUT_S."""
    slow = _ms(BULK_PING_TIMEOUT_S)
    return [(key, max(value, slow)) if key in _PING_DEADLINES else (key, value) for key, value in options]


__all__ = [
    "BULK_PING_TIMEOUT_S",
    "DEFAULT",
    "MAX_PING_STRIKES",
    "MIN_PING_INTERVAL_S",
    "RECONNECT_MAX_S",
    "RECONNECT_MIN_S",
    "Keepalive",
    "for_pushes",
]
