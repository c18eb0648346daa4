"""Structured JSON logs (structlog) for every rollwire process.

A request id is bound with `bind_request_id` in contextvars, so every line logged while a
request is handled carries it, and the proxy forwards it to replicas as `x-request-id`.
"""

from __future__ import annotations

import logging
import re
import sys
import time
import uuid

import structlog

REQUEST_ID_KEY = "x-request-id"


def setup_logging(role: str, level: str = "info", stream=None) -> None:
    """Configure structlog to write one JSON object per line, tagged with the role."""
    logging.basicConfig(format="%(message)s", stream=stream or sys.stderr, level=level.upper())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(stream or sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(role=role)


def new_request_id() -> str:
    return uuid.uuid4().hex[:16]


_ID_RE = re.compile(r"[A-Za-z0-9._:/+=@-]{1,64}")  # always fullmatch: `$` lets a final "\n" through


def request_id_from(metadata, fallback: str = "") -> str:
    """The request id from gRPC invocation metadata, else `fallback`, else a new one.

    Ids travel on as metadata and into logs, so only 1-64 printable characters of a safe
    set are kept (the whole string must match: no trailing newline); anything else is
    replaced by a fresh id rather than refused, so a replica and a proxy treat it alike."""
    for key, value in metadata or ():
        if key == REQUEST_ID_KEY and isinstance(value, str) and _ID_RE.fullmatch(value):
            return value
    return fallback if isinstance(fallback, str) and _ID_RE.fullmatch(fallback) else new_request_id()


def get_logger(name: str):
    return structlog.get_logger(name)


class Throttled:
    """One log event at most every `every_s` seconds: a flood (accept errors, refused
    connections, a fleet with no replica) becomes one line a second saying how many it stands
    for, so no caller can fill the disk through the log."""

    def __init__(self, logger, event: str, every_s: float = 1.0) -> None:
        self.logger, self.event, self.every_s = logger, event, every_s
        self.last = float("-inf")
        self.suppressed = 0

    def __call__(self, level: str = "warning", **fields) -> None:
        now = time.monotonic()
        if now - self.last < self.every_s:
            self.suppressed += 1
            return
        getattr(self.logger, level)(self.event, suppressed=self.suppressed, **fields)
        self.last, self.suppressed = now, 0
