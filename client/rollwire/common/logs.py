"""Structured JSON logs (structlog) for every rollwire process.

A request id is bound with `bind_request_id` in contextvars, so every line logged while a
request is handled carries it, and the proxy forwards it to replicas as `x-request-id`.
"""

from __future__ import annotations

import logging
import sys
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


def request_id_from(metadata, fallback: str = "") -> str:
    """The request id from gRPC invocation metadata, else `fallback`, else a new one."""
    for key, value in metadata or ():
        if key == REQUEST_ID_KEY and value:
            return str(value)[:64]
    return fallback[:64] or new_request_id()


def get_logger(name: str):
    return structlog.get_logger(name)
