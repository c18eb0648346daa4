"""Bearer-token roles and TLS for every rollwire server (generator and proxy).

Two roles: `generate` (Generate, GetStatus) and `admin` (everything, including PushAdapter
and the proxy's AdminService). Tokens come from files (Kubernetes Secrets mount as files),
one per line, and are never logged. Every RPC of a rollwire.v1 service must appear in
METHOD_ROLES: a method without an entry is refused (fail closed), and a test walks the
proto descriptors so a new RPC cannot be forgotten. Health and reflection stay open so
probes work. With TLS configured the server listens only on a TLS port: plaintext is refused.
"""

from __future__ import annotations

import hmac
from pathlib import Path

import grpc
from pydantic import Field

from rollwire.common.config import Section
from rollwire.common.errors import PermissionDenied, RollwireError, Unauthenticated, to_status

GENERATE, ADMIN = "generate", "admin"
PROTECTED_PREFIX = "/rollwire.v1."
METHOD_ROLES = {
    "/rollwire.v1.GeneratorService/Generate": GENERATE,
    "/rollwire.v1.GeneratorService/GetStatus": GENERATE,
    "/rollwire.v1.GeneratorService/PushAdapter": ADMIN,
    "/rollwire.v1.AdminService/RegisterGenerator": ADMIN,
    "/rollwire.v1.AdminService/DeregisterGenerator": ADMIN,
    "/rollwire.v1.AdminService/ListGenerators": ADMIN,
    "/rollwire.v1.AdminService/DrainGenerator": ADMIN,
}


class AuthSection(Section):
    """Bearer tokens; auth is on when either file is set."""

    generate_tokens_file: str = Field("", description="File of tokens with the `generate` role, one per line.")
    admin_tokens_file: str = Field("", description="File of tokens with the `admin` role (all RPCs), one per line.")


class TlsSection(Section):
    """Server TLS; mutual TLS when client_ca_file is set."""

    cert_file: str = Field("", description="PEM server certificate chain; TLS is on when set.")
    key_file: str = Field("", description="PEM private key of the server certificate.")
    client_ca_file: str = Field("", description="PEM CA that signs client certificates; set to require mutual TLS.")
    health_port: int = Field(
        0, ge=0, le=65535,
        description="Plaintext port serving only grpc.health.v1 (kubelet gRPC probes cannot speak TLS); 0 = off.",
    )


def read_tokens(path: str) -> set[str]:
    """Tokens in a file, one per line; blank lines and # comments are ignored."""
    if not path:
        return set()
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise SystemExit(f"cannot read token file {path}: {exc.strerror}") from None
    tokens = {line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")}
    if not tokens:
        raise SystemExit(f"token file {path} holds no token")
    return tokens


class TokenAuth:
    """Decides, for one call, whether its bearer token grants the method's role."""

    def __init__(self, generate_tokens: set[str], admin_tokens: set[str]) -> None:
        self._tokens = [(t, GENERATE) for t in generate_tokens] + [(t, ADMIN) for t in admin_tokens]

    @classmethod
    def from_config(cls, auth: AuthSection) -> TokenAuth | None:
        if not (auth.generate_tokens_file or auth.admin_tokens_file):
            return None
        return cls(read_tokens(auth.generate_tokens_file), read_tokens(auth.admin_tokens_file))

    def check(self, method: str, metadata) -> None:
        """Raise Unauthenticated or PermissionDenied; return when the call may proceed."""
        if not method.startswith(PROTECTED_PREFIX):
            return
        needed = METHOD_ROLES.get(method)
        short = method.rsplit("/", 1)[-1]
        if needed is None:
            raise PermissionDenied(f"{short} has no role assigned on this server; refusing it", reason="NO_ROLE")
        header = next((v for k, v in metadata or () if k == "authorization"), None)
        if not header:
            raise Unauthenticated(
                f"{short} needs a bearer token: send `authorization: Bearer <token>` (the CLI's --token-file)",
                reason="NO_TOKEN",
            )
        scheme, _, token = str(header).partition(" ")
        role = self._role_of(token.strip()) if scheme.lower() == "bearer" else None
        if role is None:
            raise Unauthenticated("the bearer token is not valid on this server", reason="BAD_TOKEN")
        if needed == ADMIN and role != ADMIN:
            raise PermissionDenied(f"{short} needs the admin role; this token has the generate role", reason="WRONG_ROLE")

    def _role_of(self, token: str) -> str | None:
        found = None
        for known, role in self._tokens:  # compare every token in constant time
            if hmac.compare_digest(known.encode(), token.encode()):
                found = ADMIN if ADMIN in (found, role) else role
        return found


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls whose token lacks the method's role, before any handler runs."""

    def __init__(self, auth: TokenAuth) -> None:
        self.auth = auth

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        try:
            self.auth.check(details.method, details.invocation_metadata)
        except RollwireError as err:
            return _refusing(handler, err)
        return handler


def _refusing(handler: grpc.RpcMethodHandler | None, err: RollwireError) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that only aborts with `err`."""
    status = to_status(err)

    async def unary(request_or_iterator, context):
        await context.abort_with_status(status)

    async def streaming(request_or_iterator, context):
        await context.abort_with_status(status)
        yield  # pragma: no cover - makes this an async generator

    if handler is None or handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(streaming)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary)
    return grpc.stream_stream_rpc_method_handler(streaming)


def interceptors(auth: AuthSection) -> list[grpc.aio.ServerInterceptor]:
    token_auth = TokenAuth.from_config(auth)
    return [AuthInterceptor(token_auth)] if token_auth else []


def add_port(server: grpc.aio.Server, address: str, tls: TlsSection) -> int:
    """Listen on `address`, with TLS (and mTLS) when configured; returns the bound port."""
    if not tls.cert_file:
        return server.add_insecure_port(address)
    if not tls.key_file:
        raise SystemExit("tls.cert_file is set but tls.key_file is not; give both")
    try:
        key, cert = Path(tls.key_file).read_bytes(), Path(tls.cert_file).read_bytes()
        client_ca = Path(tls.client_ca_file).read_bytes() if tls.client_ca_file else None
    except OSError as exc:
        raise SystemExit(f"cannot read TLS file {exc.filename}: {exc.strerror}") from None
    credentials = grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )
    return server.add_secure_port(address, credentials)


async def start_health_port(health_servicer, host: str, tls: TlsSection) -> grpc.aio.Server | None:
    """A plaintext server with only the health service, for probes, when TLS is on."""
    from grpc_health.v1 import health_pb2_grpc

    if not (tls.cert_file and tls.health_port):
        return None
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.add_insecure_port(f"{host}:{tls.health_port}")
    await server.start()
    return server
