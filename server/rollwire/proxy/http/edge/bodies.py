"""Request bodies, read within their limit and parsed into typed models.

Limits before work: a body is refused (413) as soon as it is known to exceed its route's
limit, by its Content-Length or while it arrives (chunked too), and (400) when it has not
arrived within http.body_timeout_s; large JSON is parsed on a worker thread."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from rollwire.common.reasons import Reason
from rollwire.proxy.http.dialect.errors import HttpError
from rollwire.runtime.logs import get_logger

log = get_logger(__name__)
THREAD_PARSE_BYTES = 64 << 10
"""JSON bodies larger than this are parsed on a worker thread, not on the event loop."""


def check_length(request: Request, limit: int) -> None:
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > limit):
        raise HttpError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the request body is {length} bytes; this endpoint takes at most {limit}",
            reason=Reason.BODY_TOO_LARGE,
        )


async def body_chunks(request: Request, limit: int, timeout_s: float) -> AsyncIterator[bytes]:
    """The body's chunks as they arrive, whatever its framing (Content-Length or chunked):
    refused (413) as soon as it is known to exceed `limit` bytes, and (400) when it has not
    arrived in full `timeout_s` after the first chunk was asked for."""
    check_length(request, limit)
    deadline = asyncio.get_running_loop().time() + timeout_s
    stream = request.stream().__aiter__()
    size = 0
    while True:
        try:
            async with asyncio.timeout_at(deadline):
                chunk = await stream.__anext__()
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise HttpError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the request body did not arrive within {timeout_s:g} s (http.body_timeout_s); send it at once",
                reason=Reason.BAD_REQUEST_BODY,
            ) from None
        except ClientDisconnect:
            raise HttpError(
                grpc.StatusCode.CANCELLED, "the caller closed the connection", reason=Reason.BAD_REQUEST_BODY
            ) from None
        size += len(chunk)
        if size > limit:
            raise HttpError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the request body is over {limit} bytes, the most this endpoint takes",
                reason=Reason.BODY_TOO_LARGE,
            )
        yield chunk


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The body, refused (413) as soon as it is known to exceed `limit` bytes, and (400)
    when it has not arrived within `timeout_s`."""
    chunks = [chunk async for chunk in body_chunks(request, limit, timeout_s)]
    return b"".join(chunks)


async def parse_body(raw: bytes, kind: type[BaseModel]) -> Any:
    """`raw` as `kind`; a 400 naming the first field that is wrong."""

    def parse() -> Any:
        try:
            return kind.model_validate_json(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(x) for x in first["loc"]) or "body"
            if first["type"] == "extra_forbidden":
                raise HttpError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{where}: rollwire does not know this field; remove it (docs/http.md lists every field)",
                    reason=Reason.UNSUPPORTED_FIELD,
                    param=where,
                ) from None
            if first["type"].startswith("json"):
                raise HttpError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"the body is not valid JSON: {first['msg']}",
                    reason=Reason.BAD_REQUEST_BODY,
                ) from None
            raise HttpError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{where}: {first['msg']} (got {str(first.get('input'))[:80]!r})",
                reason=Reason.BAD_REQUEST_BODY,
                param=where,
            ) from None

    return await asyncio.to_thread(parse) if len(raw) > THREAD_PARSE_BYTES else parse()
