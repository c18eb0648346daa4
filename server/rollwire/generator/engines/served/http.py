"""How the replica talks to an engine server (sglang, vllm): who the server is, its errors, HTTP.

`ServerKind` names the server in every sentence and log event, so an SGLang failure reads
"SGLang ..." and a vLLM failure "vLLM ..."; both carry the one set of ENGINE_SERVER_* reasons.
`ServerHTTP` makes the JSON and event-stream calls with every failure mapped to a
RollwireError that keeps the server's own message.

Invariants:
- every call and each stream gap has a deadline (`request_timeout_s`, 10 s to connect, 5 s for
  a health probe);
- API keys travel in headers, never in a log; no proxy or netrc is taken from the environment;
- a transport failure tells the supervisor to probe the server at once (`on_transport_error`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus

import httpx2 as httpx

from rollwire.common.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    RollwireError,
    Unauthenticated,
    Unavailable,
)
from rollwire.common.reasons import Reason


# -- who the server is -----------------------------------------------------------------------
@dataclass(frozen=True)
class ServerKind:
    """Names one kind of engine server in sentences (`label`), config keys and log events
    (`key`), and the action to suggest per HTTP status (`hints`)."""

    label: str
    key: str
    hints: Mapping[int, str] = field(default_factory=dict)
    health_path: str = "/health"


# -- errors ----------------------------------------------------------------------------------
_CLASS_BY_STATUS: dict[int, type[RollwireError]] = {
    400: InvalidArgument,
    401: Unauthenticated,
    403: PermissionDenied,
    404: FailedPrecondition,
    408: DeadlineExceeded,
    413: InvalidArgument,
    422: InvalidArgument,
    429: ResourceExhausted,
    500: Internal,
    503: Unavailable,
    504: DeadlineExceeded,
}
_REASON_BY_STATUS: dict[int, Reason] = {
    400: Reason.ENGINE_SERVER_BAD_REQUEST,
    401: Reason.ENGINE_SERVER_UNAUTHENTICATED,
    403: Reason.ENGINE_SERVER_FORBIDDEN,
    404: Reason.ENGINE_SERVER_NO_ROUTE,
    408: Reason.ENGINE_SERVER_TIMEOUT,
    413: Reason.ENGINE_SERVER_BAD_REQUEST,
    422: Reason.ENGINE_SERVER_BAD_REQUEST,
    429: Reason.ENGINE_SERVER_OVERLOADED,
    500: Reason.ENGINE_SERVER_INTERNAL,
    503: Reason.ENGINE_SERVER_UNAVAILABLE,
    504: Reason.ENGINE_SERVER_TIMEOUT,
}
"""The reason of a server's refusal by its HTTP status, whichever server; ENGINE_SERVER_ERROR otherwise."""


def status_of(err) -> int:
    """The HTTP status an in-stream error object carries (its `code`), 400 when it has none."""
    code = err.get("code") if isinstance(err, dict) else None
    return code if isinstance(code, int) and 400 <= code < 600 else 400


def server_message(body) -> str:
    """The server's own sentence from any of its error bodies (SGLang's, vLLM's, FastAPI's)."""
    if isinstance(body, dict):
        err = body.get("error", body.get("error_message", body.get("message", body.get("detail"))))
        if isinstance(err, dict):
            err = err.get("message", err)
        if err:
            return str(err)
    return str(body)[:500] if body else "(empty body)"


def error_from_body(kind: ServerKind, status: int, body, what: str) -> RollwireError:
    """A RollwireError for a server's error reply: the server's message, a status, an action."""
    cls = _CLASS_BY_STATUS.get(status, Unavailable if status >= 500 else InvalidArgument)
    reason = _REASON_BY_STATUS.get(status, Reason.ENGINE_SERVER_ERROR)
    message = f"{kind.label} {what} failed (HTTP {status} {_phrase(status)}): {server_message(body)}"
    if status in kind.hints:
        message += f"; {kind.hints[status]}"
    retry = 1.0 if cls in (Unavailable, ResourceExhausted) else None
    return cls(message, reason=reason, retry_after_s=retry)


def error_from_reply(kind: ServerKind, status: int, raw: bytes, what: str) -> RollwireError:
    try:
        body = json.loads(raw) if raw else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        body = raw.decode("utf-8", "replace")
    return error_from_body(kind, status, body, what)


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""


def transport_error(kind: ServerKind, exc: Exception, url: str, what: str, timeout_s: float) -> RollwireError:
    """The status for a failed connection to the server, with what to do about it."""
    if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
        return Unavailable(
            f"cannot reach {kind.label} at {url} for {what} ({exc}); it is down or restarting, retry shortly",
            reason=Reason.ENGINE_SERVER_UNREACHABLE,
            retry_after_s=2.0,
        )
    if isinstance(exc, httpx.ReadTimeout):
        return DeadlineExceeded(
            f"{kind.label} at {url} sent nothing for {timeout_s:g}s during {what}; it may be overloaded or hung "
            f"(raise {kind.key}.request_timeout_s for very long generations)",
            reason=Reason.ENGINE_SERVER_TIMEOUT,
        )
    return Unavailable(
        f"{kind.label} at {url} dropped the connection during {what} ({type(exc).__name__}: {exc}); it probably "
        "crashed or restarted, so any partial samples are void: retry the whole group",
        reason=Reason.ENGINE_SERVER_CONNECTION_LOST,
        retry_after_s=2.0,
    )


# -- transport -------------------------------------------------------------------------------
class ServerHTTP:
    """JSON and event-stream calls to one server, errors mapped to RollwireError."""

    def __init__(
        self, kind: ServerKind, base_url: str, *, api_key: str | None, admin_key: str | None, timeout_s: float
    ) -> None:
        self.kind = kind
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._api_key, self._admin_key = api_key, admin_key
        self.on_transport_error: Callable[[], None] = lambda: None
        self.client = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            trust_env=False,  # no proxy or netrc taken from the environment
        )

    def _headers(self, admin: bool) -> dict[str, str]:
        # Admin routes take the admin key when one is set, else the API key (SGLang's rule;
        # vLLM has one key).
        key = (self._admin_key or self._api_key) if admin else self._api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def get_json(self, path: str, what: str, timeout_s: float | None = None) -> dict:
        with self._mapped(what):
            resp = await self.client.get(path, headers=self._headers(False), timeout=timeout_s or self.timeout_s)
        return self._json_or_raise(resp.status_code, resp.content, what)

    async def post_json(self, path: str, body: dict, what: str, *, admin: bool = False) -> dict:
        with self._mapped(what):
            resp = await self.client.post(path, json=body, headers=self._headers(admin))
        return self._json_or_raise(resp.status_code, resp.content, what)

    @contextlib.asynccontextmanager
    async def stream_lines(self, path: str, body: dict, what: str) -> AsyncIterator[AsyncIterator[str]]:
        """POST and iterate the response's lines; leaving the block closes the connection."""
        with self._mapped(what):
            async with self.client.stream("POST", path, json=body, headers=self._headers(False)) as resp:
                if resp.status_code != 200:
                    raise error_from_reply(self.kind, resp.status_code, await resp.aread(), what)
                yield resp.aiter_lines()

    async def healthy(self) -> tuple[bool, str]:
        """(True, "") when the health route answers 200, else (False, why)."""
        try:
            resp = await self.client.get(self.kind.health_path, timeout=5.0)
        except httpx.HTTPError as exc:
            return False, f"{type(exc).__name__}: {exc}"
        return resp.status_code == 200, f"HTTP {resp.status_code}"

    @contextlib.contextmanager
    def _mapped(self, what: str):
        try:
            yield
        except httpx.TransportError as exc:
            self.on_transport_error()
            raise transport_error(self.kind, exc, self.base_url, what, self.timeout_s) from None

    def _json_or_raise(self, status: int, raw: bytes, what: str) -> dict:
        if status != 200:
            raise error_from_reply(self.kind, status, raw, what)
        try:
            body = json.loads(raw) if raw else {}
        except json.JSONDecodeError:
            body = {"text": raw.decode("utf-8", "replace")}  # vLLM answers a LoRA load in plain text
        if isinstance(body, dict) and body.get("success") is False:
            raise error_from_reply(self.kind, 400, raw, what)
        return body if isinstance(body, dict) else {"value": body}

    async def aclose(self) -> None:
        await self.client.aclose()


def parse_sse_line(line: str, kind: ServerKind):
    """One line of an event stream: a chunk dict, DONE, or None for blank/other lines."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return DONE
    try:
        chunk = json.loads(data)
    except json.JSONDecodeError:
        raise Internal(f"{kind.label} sent a stream line that is not JSON: {data[:200]!r}") from None
    if not isinstance(chunk, dict):
        raise Internal(f"{kind.label} sent a stream chunk that is not an object: {data[:200]!r}")
    return chunk


DONE = object()  # the `data: [DONE]` sentinel
