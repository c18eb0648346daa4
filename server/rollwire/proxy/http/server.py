"""uvicorn serving the door on the proxy's event loop, with the proxy's TLS.

The door accepts its own connections (connections.Acceptor): uvicorn parses and answers
them, but never listens, so the caps on connections (total and per peer) and the header
deadline hold before any byte is parsed (connections.py states the invariants)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import ssl
from typing import Any

from rollwire.proxy.http.app import create_app
from rollwire.proxy.http.door import Door
from rollwire.proxy.http.edge.connections import Acceptor, DoorProtocol, Gate, Slot, connection_limit
from rollwire.runtime.logs import get_logger

log = get_logger(__name__)


class HttpServer:
    """uvicorn serving the door on the proxy's event loop; the proxy keeps its own signal
    handling (uvicorn's is switched off) and stops the door with itself."""

    def __init__(self, door: Door) -> None:
        import uvicorn

        config = self.door_config = door.config
        tls = config.tls
        self.sock = socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Accepted connections inherit it: without it a streamed event waits for the client's
        # delayed ACK behind the headers (Nagle), ~40 ms before the first token (bench §9).
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            self.sock.bind((config.host, config.http.port or 0))
        except OSError as exc:
            self.sock.close()
            raise SystemExit(f"cannot listen for HTTP on {config.host}:{config.http.port}: {exc}") from None
        self.port = self.sock.getsockname()[1]
        options: dict[str, Any] = {}
        if tls.cert_file:
            options = {"ssl_certfile": tls.cert_file, "ssl_keyfile": tls.key_file}
            if tls.client_ca_file:
                options |= {"ssl_ca_certs": tls.client_ca_file, "ssl_cert_reqs": ssl.CERT_REQUIRED}
        self.config = uvicorn.Config(
            create_app(door),
            log_config=None,
            access_log=False,
            lifespan="off",
            http="h11",  # connections.DoorProtocol extends uvicorn's h11 protocol
            timeout_keep_alive=config.http.keep_alive_s,  # pyright: ignore[reportArgumentType]  # used as a delay
            timeout_graceful_shutdown=math.ceil(config.grace_seconds) or 1,
            **options,
        )

        class _Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):  # the proxy handles SIGTERM/SIGINT itself
                yield

        self.server = _Server(self.config)
        logging.getLogger("uvicorn.error").setLevel(logging.WARNING)  # the door logs its own events (structlog)
        self._task: asyncio.Task | None = None
        self._accepting: asyncio.Task | None = None
        self.limit, nofile = connection_limit(config.http.max_connections)
        log.info(
            "http_connection_limits",
            max_connections=self.limit,
            configured=config.http.max_connections,
            per_peer=config.http.max_connections_per_peer,
            nofile_soft=nofile,
            note=f"at most 1/4 of the soft file-descriptor limit ({nofile})" if nofile else "no descriptor limit",
        )

    async def start(self) -> None:
        self.config.load()
        self.server.lifespan = self.config.lifespan_class(self.config)
        await self.server.startup(sockets=[])  # uvicorn listens on nothing: the Acceptor accepts
        self.sock.listen(self.config.backlog)
        http = self.door_config.http
        acceptor = Acceptor(
            self.sock,
            Gate(self.limit, http.max_connections_per_peer),
            self._protocol,
            self.config.ssl,
            http.header_timeout_s,
        )
        self.acceptor = acceptor
        self._accepting = asyncio.create_task(acceptor.run())
        self._task = asyncio.create_task(self.server.main_loop())

    def _protocol(self, slot: Slot) -> asyncio.Protocol:
        return DoorProtocol(
            config=self.config,
            server_state=self.server.server_state,
            app_state=self.server.lifespan.state,
            slot=slot,
            header_timeout_s=self.door_config.http.header_timeout_s,
        )

    async def stop(self) -> None:
        if self._task is None:
            return
        self.server.should_exit = True
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
            await self.acceptor.stop()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self.server.shutdown(sockets=[self.sock])
        self._task = None
