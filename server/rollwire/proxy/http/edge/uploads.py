"""multipart/form-data uploads, counted while they are read.

Invariants (audit A5):
- every byte is counted as it arrives, whatever the framing (Content-Length or chunked): the
  upload is refused (413) as soon as its total passes `total`, or one part passes its field's
  limit, before another byte of it is read;
- only the fields named in `limits` are taken, each at most once; any other field is a 400
  the moment its headers end; nothing is spooled to disk and no part is held beyond its limit;
- the body must arrive within http.body_timeout_s (bodies.body_chunks);
- the bytes of uploads the door holds at once are bounded (`UploadBudget`): in all by
  http.max_upload_bytes_in_flight, and one tenant's by half of it; each byte is counted
  against it as it arrives (or its whole Content-Length, before the first), and an upload
  that would pass either is refused (429 UPLOADS_FULL) before another byte is read, its
  bytes freed when the request ends however it ends (audit S4).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterable, Mapping

import grpc
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from rollwire.common.reasons import Reason
from rollwire.proxy.http.dialect.errors import HttpError

TENANT_UPLOAD_SHARE = 0.5
"""The share of the door's upload budget one tenant's uploads may hold at once."""


class UploadBudget:
    """Bytes of uploads the door holds in memory at once, in all and per tenant; `hold` one
    upload's (a `Holding`, released once)."""

    def __init__(self, limit: int, retry_after_s: float = 1.0) -> None:
        self.limit, self.retry_after_s = limit, retry_after_s
        self.tenant_limit = max(1, int(limit * TENANT_UPLOAD_SHARE))
        self.held = 0
        self.by_tenant: Counter[str] = Counter()

    def hold(self, tenant: str) -> Holding:
        return Holding(self, tenant)

    def take(self, tenant: str, size: int) -> None:
        """Count `size` more bytes of `tenant`'s, or refuse them (nothing counted)."""
        if self.by_tenant[tenant] + size > self.tenant_limit or self.held + size > self.limit:
            mine = self.by_tenant[tenant] + size > self.tenant_limit
            raise HttpError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the door holds {self.by_tenant[tenant] if mine else self.held} bytes of uploads "
                f"{'of your tenant ' if mine else ''}in flight, and this one would take it over "
                f"{self.tenant_limit if mine else self.limit} (http.max_upload_bytes_in_flight"
                f"{', of which one tenant may hold half' if mine else ''}); retry when they have ended",
                reason=Reason.UPLOADS_FULL,
                retry_after_s=self.retry_after_s,
            )
        self.held += size
        self.by_tenant[tenant] += size

    def give(self, tenant: str, size: int) -> None:
        self.held -= size
        self.by_tenant[tenant] -= size
        if self.by_tenant[tenant] <= 0:
            del self.by_tenant[tenant]


class Holding:
    """One upload's bytes in the budget: `grow` as they arrive, `release` (idempotent) when the
    request ends; a context manager."""

    def __init__(self, budget: UploadBudget, tenant: str) -> None:
        self.budget, self.tenant, self.size = budget, tenant, 0

    def grow(self, size: int) -> None:
        self.budget.take(self.tenant, size)
        self.size += size

    def reach(self, size: int) -> None:
        """At least `size` bytes held (a declared Content-Length, before its first byte)."""
        if size > self.size:
            self.grow(size - self.size)

    def release(self) -> None:
        size, self.size = self.size, 0
        if size:
            self.budget.give(self.tenant, size)

    def __enter__(self) -> Holding:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class FormReader:
    """The fields of one multipart body fed in chunks of any size, each bounded by its limit."""

    def __init__(
        self,
        content_type: str,
        limits: Mapping[str, int],
        total: int,
        holding: Holding | None = None,
        refusals: Mapping[str, HttpError] | None = None,
    ) -> None:
        kind, options = parse_options_header(content_type)
        boundary = options.get(b"boundary")
        if kind != b"multipart/form-data" or not boundary:
            raise _bad("the upload must be multipart/form-data with a boundary")
        self.limits, self.total, self.holding = dict(limits), total, holding
        self.refusals = dict(refusals or {})
        """The error a field past its limit gets, when not BODY_TOO_LARGE (the spool's room)."""
        self.size = 0
        self.parts: dict[str, bytearray] = {}
        self._field: str | None = None
        self._header: list[bytes] = [b"", b""]
        self._disposition = b""
        self._parser = MultipartParser(
            boundary,
            {
                "on_header_field": lambda data, start, end: self._add_header(0, data[start:end]),
                "on_header_value": lambda data, start, end: self._add_header(1, data[start:end]),
                "on_header_end": self._header_end,
                "on_headers_finished": self._headers_finished,
                "on_part_data": self._part_data,
            },
        )

    def feed(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.total:
            raise HttpError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the upload is over {self.total} bytes, the most this endpoint takes",
                reason=Reason.BODY_TOO_LARGE,
            )
        if self.holding is not None:
            self.holding.reach(self.size)
        try:
            self._parser.write(chunk)
        except MultipartParseError as exc:
            raise _bad(f"the upload is not valid multipart/form-data ({str(exc)[:120]})") from None

    def finish(self) -> dict[str, bytes]:
        try:
            self._parser.finalize()
        except MultipartParseError as exc:
            raise _bad(f"the upload is not valid multipart/form-data ({str(exc)[:120]})") from None
        return {name: bytes(data) for name, data in self.parts.items()}

    def _add_header(self, which: int, data: bytes) -> None:
        self._header[which] += data

    def _header_end(self) -> None:
        name, value = self._header
        if name.strip().lower() == b"content-disposition":
            self._disposition = value
        self._header = [b"", b""]

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        self._disposition = b""
        name = options.get(b"name", b"").decode("utf-8", "replace")
        if name not in self.limits:
            raise _bad(f"the upload has a field {name[:80]!r}; it takes only {', '.join(self.limits)}")
        if name in self.parts:
            raise _bad(f"the upload has the field {name!r} twice; send it once")
        self._field = name
        self.parts[name] = bytearray()

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        assert self._field is not None  # the parser gives data only after a part's headers
        part = self.parts[self._field]
        part += data[start:end]
        if len(part) > self.limits[self._field]:
            if self._field in self.refusals:
                raise self.refusals[self._field]
            raise HttpError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the upload's {self._field} is over {self.limits[self._field]} bytes, the most this proxy takes",
                reason=Reason.BODY_TOO_LARGE,
            )


async def read_form(
    content_type: str,
    chunks: AsyncIterable[bytes],
    limits: Mapping[str, int],
    total: int,
    holding: Holding | None = None,
    refusals: Mapping[str, HttpError] | None = None,
) -> dict[str, bytes]:
    """The fields of a multipart body arriving as `chunks`, each within its limit (past it, the
    field's error in `refusals`, else BODY_TOO_LARGE), and its bytes within `holding`'s budget."""
    reader = FormReader(content_type, limits, total, holding, refusals)
    async for chunk in chunks:
        reader.feed(chunk)
    return reader.finish()


def _bad(message: str) -> HttpError:
    return HttpError(grpc.StatusCode.INVALID_ARGUMENT, message, reason=Reason.BAD_REQUEST_BODY)
