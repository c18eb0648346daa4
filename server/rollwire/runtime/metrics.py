"""Declaring Prometheus metrics the same way in every process: each layer names its series
`rollwire_<layer>_...` (docs/metrics.md) in a registry of its own, so several services can run
in one process (the tests) without their series mixing.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Sequence
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

SHUTDOWN_POLL_S = 0.05
"""How often the metrics server's loop looks for a shutdown request: its `shutdown()` waits for
that look, and prometheus_client's start_http_server looks every 0.5 s, which every stop of a
rollwire server waited up to (issue 33: the suite stops ~200 processes)."""


class MetricFactory:
    """Builds metrics named `prefix + name` in `registry`; labels come from fixed sets only."""

    def __init__(self, prefix: str, registry: CollectorRegistry) -> None:
        self.prefix, self.registry = prefix, registry

    def counter(self, name: str, text: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(self.prefix + name, text, list(labels), registry=self.registry)

    def gauge(self, name: str, text: str, labels: Sequence[str] = ()) -> Gauge:
        return Gauge(self.prefix + name, text, list(labels), registry=self.registry)

    def histogram(self, name: str, text: str, labels: Sequence[str] = (), *, buckets: Sequence[float]) -> Histogram:
        return Histogram(self.prefix + name, text, list(labels), buckets=buckets, registry=self.registry)


def serve_metrics(host: str, port: int, registry: CollectorRegistry) -> WSGIServer:
    """Serve `registry` at http://host:port/metrics on a daemon thread, as prometheus_client's
    start_http_server does (its WSGI app, a thread per request, no request logs, the address
    family of `host`), except that `shutdown()` returns within SHUTDOWN_POLL_S."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    server_class = type("MetricsServer", (ThreadingWSGIServer,), {"address_family": family})
    server = make_server(str(address[0]), port, make_wsgi_app(registry), server_class, handler_class=_Quiet)
    thread = threading.Thread(target=server.serve_forever, args=(SHUTDOWN_POLL_S,), name="rollwire-metrics")
    thread.daemon = True
    thread.start()
    return server


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """Log nothing: a scrape every few seconds is not an event."""
