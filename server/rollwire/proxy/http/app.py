"""The HTTP door's routes and its server, in the proxy's process and event loop (docs/http.md).

Invariants:
- limits before work: a body is read only up to its route's limit (413 beyond it), and only
  after the caller's token passed; JSON is parsed off the event loop when it is large;
- every generation request has a deadline (`http.request_timeout_s`, capped by the proxy's
  `routing.request_timeout_s`) and runs under the caller's per-client limits, as a gRPC call;
- a streamed response whose reader stops reading for `fairness.slow_reader_timeout_s` is
  ended, which closes its group (lease and client slot freed);
- one request's failure ends that request only: every exception becomes that request's
  error response (errors.py), an unexpected one a logged 500;
- a tenant's caller (proxy/tenants.py; its token as Bearer, or as Basic's password from a base
  URL `http://TENANT:TOKEN@host`) names its own adapters, qualified here before the core sees
  them, and reads its own names back (/v1/models, load and unload answers, error sentences);
  the token is never logged (the access log has the path only).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Sequence
from typing import Any

import grpc
import structlog
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from rollwire.common.errors import Internal, RollwireError, Unavailable
from rollwire.common.reasons import Reason
from rollwire.proxy.accounting import RequestRecord
from rollwire.proxy.http import tokens
from rollwire.proxy.http.dialect import convert, tools
from rollwire.proxy.http.dialect.errors import HttpError, error_response, http_status
from rollwire.proxy.http.dialect.openai import (
    ChatBody,
    ChatTokensBody,
    CompletionBody,
    check_unhonoured,
    flatten_content,
    template_takes_parts,
)
from rollwire.proxy.http.dialect.vocabulary import Asked, http_terms
from rollwire.proxy.http.door import Door
from rollwire.proxy.http.echo import echo_scores, wants_scoring
from rollwire.proxy.http.edge.bodies import parse_body, read_body
from rollwire.proxy.http.generate import GenerateBody, generate
from rollwire.proxy.http.loads import add_adapter_routes
from rollwire.proxy.http.pause import MODES
from rollwire.proxy.http.scoped import scope_of
from rollwire.proxy.http.stream import stream_group
from rollwire.proxy.http.weights import add_weight_routes
from rollwire.proxy.metrics import HTTP_ROUTES
from rollwire.proxy.routing.passthrough import PassThrough
from rollwire.proxy.tenants import Scope
from rollwire.runtime.logs import Throttled, get_logger
from rollwire.runtime.security import ADMIN, GENERATE, PUBLISH, caller_identity
from rollwire.serving import __version__

log = get_logger(__name__)
_health_log = Throttled(log, "http_health_no_replica")


def create_app(door: Door) -> FastAPI:
    """The FastAPI application of the door; every route is declared in metrics.HTTP_ROUTES."""
    app = FastAPI(title="rollwire", docs_url=None, redoc_url=None, openapi_url=None)
    _observe(app, door)
    _vllm_routes(app, door)
    add_weight_routes(app, door, _authorize)  # /weight_info: the fleet's proofs (http/weights.py)
    _pause_routes(app, door)
    add_adapter_routes(app, door, _authorize, _body)
    _openai_routes(app, door)
    _rl_routes(app, door)
    return app


def _authorize(door: Door, request: Request, role: str) -> str:
    """The caller's identity for the per-client limits, once its token grants `role` (ADMIN:
    or `publish`, for the adapter routes: its own tenant's adapters); its role and names' scope
    go in request.state (`role`, `scope`)."""
    header = request.headers.get("authorization")
    if door.auth is not None:
        door.auth.require(role, header, request.url.path, also=(PUBLISH,) if role == ADMIN else ())
    request.state.role, request.state.scope = door.core.caller([("authorization", header or "")])
    peer = request.client
    host = f"ipv4:{peer.host}:{peer.port}" if peer else "unknown"
    return caller_identity([("authorization", header or "")], host, door.auth is not None)


def _health(door: Door, request: Request) -> Response:
    """Open for probes; what each replica is doing (addresses, errors) only for an admin (audit A12)."""
    routable, detail = door.core.fleet_health()
    if routable:
        return Response(status_code=200)
    _health_log(level="info", replicas=detail[:1000])
    header = request.headers.get("authorization", "")
    admin = door.auth is not None and door.auth.role([("authorization", header)]) == ADMIN
    return error_response(
        Unavailable(
            f"no replica is routable ({detail})" if admin else "no replica is routable; retry later",
            reason=Reason.NO_REPLICA,
            retry_after_s=door.config.routing.retry_after_s,
        )
    )


async def _body(door: Door, request: Request, kind: type[BaseModel]) -> Any:
    http = door.config.http
    return await parse_body(await read_body(request, http.max_body_bytes, http.body_timeout_s), kind)


class _Observe:
    """Per-route metrics and the request id of every request, timed to its last byte (a
    streamed response included). A plain ASGI middleware: Starlette's BaseHTTPMiddleware
    relays a streamed body through a task and a memory stream, which cost the door about a
    sixth of its CPU per streamed event (measured with py-spy under bench/http_overhead.py)."""

    def __init__(self, app: Any, metrics: Any) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.monotonic(), [500]
        route = _route_label(scope["path"])
        asked = next((v for k, v in scope["headers"] if k == b"x-request-id"), b"")
        rid = asked.decode("latin-1")[:128] or uuid.uuid4().hex
        scope.setdefault("state", {})["rid"] = rid  # request.state.rid in the routes

        async def observed(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        structlog.contextvars.bind_contextvars(request_id=rid)
        try:
            await self.app(scope, receive, observed)
        finally:
            self.metrics.http_requests.labels(route, str(status[0])).inc()
            self.metrics.http_latency.labels(route).observe(time.monotonic() - start)
            structlog.contextvars.unbind_contextvars("request_id")


def _observe(app: FastAPI, door: Door) -> None:
    """Per-route metrics and the request id of every request; errors as OpenAI bodies."""
    app.add_middleware(_Observe, metrics=door.core.state.metrics)  # pyright: ignore[reportArgumentType]  # any ASGI middleware class

    @app.exception_handler(RollwireError)
    async def rollwire_error(request: Request, err: RollwireError):
        err.message = scope_of(request).scrub(err.message)
        _log_refusal(request, err)
        return error_response(err)

    @app.exception_handler(PassThrough)
    async def relayed(request: Request, relay: PassThrough):
        err = relay.error()
        err.message = scope_of(request).scrub(err.message)
        _log_refusal(request, err)
        return error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def no_route(request: Request, exc: StarletteHTTPException):
        """Routing's own answers (no such route, a method the route does not take) in the
        documented error shape, not FastAPI's {"detail": ...}."""
        method, path = request.method, request.url.path[:200]
        if exc.status_code == 405:
            err = HttpError(
                grpc.StatusCode.UNIMPLEMENTED,
                f"{path} does not take {method} (docs/http.md lists each route's method)",
                reason="",
                status=405,
            )
        else:
            err = HttpError(
                grpc.StatusCode.NOT_FOUND,
                f"no route {method} {path} on rollwire's HTTP door; docs/http.md lists the routes it serves",
                reason="",
                status=exc.status_code if exc.status_code >= 400 else 404,
            )
        return error_response(err)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        log.error("http_request_failed", route=request.url.path, error=repr(exc)[:500], exc_info=exc)
        return error_response(Internal("the proxy failed on this request; it is logged"))


def _vllm_routes(app: FastAPI, door: Door) -> None:
    """The vLLM server calls TRL makes besides sampling and pausing: health, server info, models, tokens."""

    @app.get("/health")
    async def health(request: Request) -> Response:
        return _health(door, request)

    @app.get("/server_info")
    async def server_info(request: Request) -> JSONResponse:
        _authorize(door, request, GENERATE)
        info = door.server_info()
        if request.state.role != ADMIN:  # the fleet's topology is an admin's to read (GetStatus's rule)
            info["rollwire"]["replicas"] = []
        return JSONResponse(info)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        _authorize(door, request, GENERATE)
        return JSONResponse(door.models(request.state.scope))

    @app.get("/v1/models/{model:path}")
    async def model(request: Request, model: str) -> JSONResponse:
        _authorize(door, request, GENERATE)
        return JSONResponse(door.model(model, request.state.scope))

    @app.get("/version")
    async def version() -> JSONResponse:
        """rollwire's version (vLLM answers its own here); open, as vLLM's is."""
        return JSONResponse({"version": __version__})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        client = _authorize(door, request, GENERATE)
        body = await _body(door, request, tokens.TokenizeBody)
        return JSONResponse(await tokens.tokenize(door, body, client, request.state.scope))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        _authorize(door, request, GENERATE)
        body = await _body(door, request, tokens.DetokenizeBody)
        return JSONResponse(await tokens.detokenize(door, body, request.state.scope))


def _pause_routes(app: FastAPI, door: Door) -> None:
    """vLLM's /pause, /resume and /is_paused, per tenant (http/pause.py)."""

    @app.post("/pause")
    async def pause(request: Request) -> JSONResponse:
        """Holds the caller's tenant's new generation requests until /resume (http/pause.py);
        `mode` as vLLM's: "wait" also waits for its requests in flight, "keep" and "abort" not."""
        _authorize(door, request, ADMIN)
        mode = request.query_params.get("mode", "abort")
        if mode not in MODES:
            raise HttpError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"mode must be one of {', '.join(MODES)}, not {mode[:40]!r}",
                reason=Reason.BAD_REQUEST_BODY,
                param="mode",
            )
        await door.pauses.pause(request.state.scope.label, mode)
        return JSONResponse({"status": "paused"})

    @app.post("/resume")
    async def resume(request: Request) -> JSONResponse:
        _authorize(door, request, ADMIN)
        door.pauses.resume(request.state.scope.label)
        return JSONResponse({"status": "resumed"})

    @app.get("/is_paused")
    async def is_paused(request: Request) -> JSONResponse:
        _authorize(door, request, GENERATE)
        return JSONResponse({"is_paused": door.pauses.paused(request.state.scope.label)})


def _openai_routes(app: FastAPI, door: Door) -> None:
    """OpenAI's completions and chat completions, converted once into the core's groups; each
    request recorded in the core metrics as a gRPC Generate is (accounting.py), refusals at the
    edge included."""

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        client = _authorize(door, request, GENERATE)
        with door.core.account(edge=True) as record:
            record.tenant = request.state.scope.label
            body: CompletionBody = await _body(door, request, CompletionBody)
            if wants_scoring(body):  # a Score, counted as one by the core: not a generation
                record.hand_over()
                rid = body.request_id or request.state.rid
                prompts = [await door.prompt_ids(p, client) for p in _prompt_list(door, body)]
                with http_terms(Asked(body, 0, None, door.limits)):
                    return JSONResponse(await echo_scores(door, body, prompts, client, rid, request.state.scope))
            return await _completions(door, body, client, request.state.rid, record, request.state.scope)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _chat(door, request, ChatBody)

    @app.post("/v1/chat/completions/tokens")
    async def chat_tokens(request: Request) -> Response:
        """prime-rl's vLLM extension (verifiers' training client, from turn 2): a chat completion
        sampled from the body's `tokens` as sent, answered as /v1/chat/completions answers."""
        return await _chat(door, request, ChatTokensBody)


async def _chat(door: Door, request: Request, kind: type[ChatBody]) -> Response:
    """A chat completion: the chat rendered by the model's template, or a ChatTokensBody's `tokens`
    as its prompt; its calls parsed (http.tool_call_parser)."""
    client = _authorize(door, request, GENERATE)
    with door.core.account(edge=True) as record:
        record.tenant = request.state.scope.label
        body: ChatBody = await _body(door, request, kind)
        check_unhonoured(body)
        tools.check_tool_choice(body, door.config.http.tool_call_parser)
        ref = door.resolve(body.model, request.state.scope)
        if isinstance(body, ChatTokensBody):
            prompt = list(body.tokens)
        else:
            prompt = await door.chat_prompt(_as_template_takes_it(door, body), client)
        rid = body.request_id or request.state.rid
        max_tokens = body.max_completion_tokens or body.max_tokens or door.default_max_tokens(len(prompt))
        req = convert.generate_request(body, prompt, ref, max_tokens, rid, door.config.http.return_routed_experts)
        record.edge = False  # the core decides from here
        with http_terms(Asked(body, max_tokens, len(prompt), door.limits)):
            if body.stream:
                return await stream_group(door, body, req, client, "chat.completion.chunk", rid, record)
            group = convert.Group(body.n, body.stop_list())
            await door.run_group(req, client, group, door.deadline(), record.tenant)
        parse = tools.parser_for(body, door.tool_format)
        return JSONResponse(convert.chat_response(body, group, body.model, rid, door.token_text, parse))


def _rl_routes(app: FastAPI, door: Door) -> None:
    """vLLM's tokens-in, tokens-out RL route (generate.py), recorded as completions are."""

    @app.post("/inference/v1/generate")
    async def tokens_out(request: Request) -> Response:
        client = _authorize(door, request, GENERATE)
        with door.core.account(edge=True) as record:
            record.tenant = request.state.scope.label
            body: GenerateBody = await _body(door, request, GenerateBody)
            answer = await generate(door, body, client, request.state.rid, record, request.state.scope)
            return answer if isinstance(answer, Response) else JSONResponse(answer)


def _as_template_takes_it(door: Door, body: ChatBody) -> ChatBody:
    """The chat as vLLM hands it to the template: content parts flattened to text (or kept, for
    a template that loops over them), `reasoning_effort` among the template's variables."""
    template = door.tokenizer.chat_template if door.tokenizer is not None else None
    body.messages = flatten_content(body.messages, template_takes_parts(template))
    if body.reasoning_effort is not None:
        body.chat_template_kwargs = {"reasoning_effort": body.reasoning_effort, **(body.chat_template_kwargs or {})}
    return body


async def _completions(
    door: Door, body: CompletionBody, client: str, rid: str, record: RequestRecord, scope: Scope
) -> Response:
    """POST /v1/completions: one group per prompt, all run together (the first failure is the answer)."""
    check_unhonoured(body)
    ref = door.resolve(body.model, scope)
    prompts = _prompt_list(door, body)
    if body.stream and len(prompts) > 1:
        raise HttpError(
            grpc.StatusCode.INVALID_ARGUMENT,
            "stream one prompt per request (or set stream to false for a batch of prompts)",
            reason=Reason.UNSUPPORTED_FIELD,
            param="stream",
        )
    rid = body.request_id or rid
    max_tokens = body.max_tokens or 16
    requests = [
        convert.generate_request(
            body, p, ref, max_tokens, rid if len(prompts) == 1 else f"{rid}-{i}", door.config.http.return_routed_experts
        )
        for i, p in enumerate(prompts)
    ]
    record.edge = False  # the core decides from here
    known = len(prompts[0]) if len(prompts) == 1 and not isinstance(prompts[0], str) else None
    with http_terms(Asked(body, max_tokens, known, door.limits)):
        if body.stream:
            return await stream_group(door, body, requests[0], client, "text_completion", rid, record)
        deadline = door.deadline()
        groups = [convert.Group(body.n, body.stop_list()) for _ in requests]
        runs = [door.run_group(r, client, g, deadline, record.tenant) for r, g in zip(requests, groups, strict=True)]
        await _all_or_first_error(runs)
    return JSONResponse(convert.completion_response(body, groups, body.model, rid, door.token_text))


def _prompt_list(door: Door, body: CompletionBody) -> list[str | list[int]]:
    """The body's prompts, 1 to http.max_prompts of them."""
    prompts, most = body.prompts(), door.config.http.max_prompts
    if not prompts or len(prompts) > most:
        raise HttpError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"prompt holds {len(prompts)} prompts; send 1 to {most} per request",
            reason=Reason.BAD_REQUEST_BODY,
            param="prompt",
        )
    return prompts


async def _all_or_first_error(runs: Sequence[Awaitable[None]]) -> None:
    """Run the groups of one request together; the first failure cancels the others and is
    the request's answer (raised as it is, so its status reaches the caller)."""
    tasks = [asyncio.ensure_future(r) for r in runs]
    try:
        for done in asyncio.as_completed(tasks):
            await done
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _route_label(path: str) -> str:
    """The route's label in rollwire_proxy_http_requests_total (a fixed set: metrics.HTTP_ROUTES)."""
    if path in HTTP_ROUTES:
        return path
    return "/v1/models/{id}" if path.startswith("/v1/models/") else "other"


def _log_refusal(request: Request, err: RollwireError) -> None:
    log.info(
        "http_refused", route=request.url.path, status=http_status(err), reason=err.reason, error=err.message[:300]
    )
