"""Bearer-token roles and TLS for every rollwire server (generator and proxy).

Five roles: `generate` (Generate, GetStatus), `admin` (everything), two narrow ones a
replica holds: `relay` (PushAdapter, and only a `stage_only` push: it can stage bytes that an
admin commits, never serve them, commit or call anything else) and `register` (the proxy's
RegisterGenerator, DrainGenerator and DeregisterGenerator, for the caller's own address only,
checked by the handler), and one a peer proxy holds: `peer` (GetStatus, PushAdapter only with the
peer marker: a version for the spool, never fanned out, and ShareLineages, the lineage map;
both from this role only, so no admin can make a proxy's spool or names diverge), and one a replica
gives its proxy: `member` (the GeneratorService methods, on that replica only: a token derived from
the fleet key and the replica's own advertised address, runtime/members.py; never accepted by a
proxy). `caller_role` tells a handler which role a call has, for the checks
a method's role cannot express. Tokens come from files (Kubernetes Secrets mount as files),
one per line, and are never logged; a token file is re-read when it changes (token_files.py),
so rotation needs no restart, and a file that turns unreadable or empty keeps the tokens it
held (logged as an error). Every RPC
of a rollwire.v1 service must appear in METHOD_ROLES: a method without an entry is refused
(fail closed), and a test walks the proto descriptors so a new RPC cannot be forgotten.
Health and reflection stay open so probes work. With TLS configured the server listens only
on a TLS port: plaintext is refused.
A server that binds a non-loopback address without auth or without TLS says so at start, in
its log and on stderr (`warn_if_exposed`).

Tenants (a proxy's; rollwire.proxy.tenants): a token may belong to one tenant, with the
`generate` role or `publish` (all that generate may, and PushAdapter, of its own tenant's
adapters only: the proxy qualifies the names; never a fleet operation). `grant` says a call's
role and tenant; a token listed for two tenants, or for a tenant and the fleet, is refused as
not valid (logged, never the token), so a token maps to at most one tenant. A token in no
tenant is the fleet's, with the role its file gives, as without tenants. A header may present
its token as `Bearer TOKEN` or as HTTP Basic's password (token_files.presented_token).
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import NamedTuple

import grpc
from pydantic import Field

from rollwire.common.errors import PermissionDenied, RollwireError, Unauthenticated, to_status
from rollwire.common.reasons import Reason
from rollwire.runtime.config import Section
from rollwire.runtime.hosts import parse_ip
from rollwire.runtime.logs import get_logger
from rollwire.runtime.token_files import TokenFile, digest, presented_token

log = get_logger(__name__)

GENERATE, RELAY, REGISTER, PEER, MEMBER, ADMIN = "generate", "relay", "register", "peer", "member", "admin"
PUBLISH = "publish"
"""A tenant's trainer, at a proxy: what `generate` may, and its own tenant's pushes (PUBLISH_METHODS)."""
PROTECTED_PREFIX = "/rollwire.v1."
METHOD_ROLES = {
    "/rollwire.v1.GeneratorService/Generate": GENERATE,
    "/rollwire.v1.GeneratorService/GetStatus": GENERATE,
    "/rollwire.v1.GeneratorService/Score": GENERATE,  # logprobs only: what Generate reports for its own tokens
    "/rollwire.v1.GeneratorService/PushAdapter": RELAY,  # relay: stage_only only (the servicers check)
    "/rollwire.v1.GeneratorService/CommitAdapter": ADMIN,
    "/rollwire.v1.AdminService/RegisterGenerator": REGISTER,  # register: its own address only (admin.py)
    "/rollwire.v1.AdminService/DeregisterGenerator": REGISTER,
    "/rollwire.v1.AdminService/ListGenerators": ADMIN,
    "/rollwire.v1.AdminService/DrainGenerator": REGISTER,
    "/rollwire.v1.AdminService/ShareLineages": PEER,  # from that role only, not admin (PEER_ONLY)
    "/rollwire.v1.AdminService/ProveAdapters": ADMIN,  # Score traffic on every replica: an operator's call
    "/rollwire.v1.LearnerService/SubmitTrajectories": ADMIN,  # ingest: a trajectory steers the published weights
    "/rollwire.v1.LearnerService/GetIngestStatus": ADMIN,
}
"""The least role each method needs; `admin` may call every method."""
PEER_METHODS = frozenset({"/rollwire.v1.GeneratorService/PushAdapter", "/rollwire.v1.GeneratorService/GetStatus"})
"""What the `peer` role may call besides: a peer proxy asks who a proxy is and shares versions."""
PEER_ONLY = frozenset({"/rollwire.v1.AdminService/ShareLineages"})
"""What only the `peer` role may call, not even `admin`: a peer proxy's lineage map."""
PUBLISH_METHODS = frozenset({"/rollwire.v1.GeneratorService/PushAdapter"})
"""What the `publish` role may call besides generate's methods (the proxy's servicer qualifies the name)."""
MEMBER_METHODS = frozenset(m for m in METHOD_ROLES if m.startswith("/rollwire.v1.GeneratorService/"))
"""What the `member` role may call on its own replica: what a proxy does to a member."""


class AuthSection(Section):
    """Bearer tokens; auth is on when any file is set."""

    generate_tokens_file: str = Field(default="")
    """File of tokens with the `generate` role, one per line."""
    admin_tokens_file: str = Field(default="")
    """File of tokens with the `admin` role (all RPCs), one per line."""
    relay_tokens_file: str = Field(default="")
    """File of tokens with the `relay` role (a replica: stage_only PushAdapter, what relay hops send), one per line."""
    register_tokens_file: str = Field(default="")
    """File of tokens with the `register` role (a proxy: a replica registering, draining or removing its own address),
    one per line."""
    peer_tokens_file: str = Field(default="")
    """File of tokens with the `peer` role (a proxy: the tokens its peer proxies send, `peering.token_file` there), one
    per line. Only a push with this role may carry the peer marker."""
    member_key_file: str = Field(default="")
    """A replica: the fleet key (the proxy's upstream.member_key_file) it proves its address with when it registers,
    and, without member_trust_file, its proxy derives this replica's `member` token from (for its own advertised
    address only: docs/deploy.md, Security); empty = neither."""
    grant_tokens_file: str = Field(default="")
    """A replica: file of tokens that grant no role here, one per line: its proxies' upstream.token_file, from which
    their relay grants are keyed (as from admin_tokens_file's). A replica dialled with signed member tokens
    (member_trust_file) needs no admin token at all, so holds its proxy's here: no replica then holds what makes a
    caller admin of another (audit 2026-12-07 S6)."""
    member_trust_file: str = Field(default="")
    """A replica: a trust file (docs/security.md) of the proxies' member signing keys (their
    upstream.member_signing_key_file): a token a trusted key signed for this replica's own advertised address has the
    `member` role here, and no token derived from member_key_file does; empty = no signed member token is accepted."""

    def files(self) -> dict[str, str]:
        """Each role's token file, by role."""
        return {
            GENERATE: self.generate_tokens_file,
            RELAY: self.relay_tokens_file,
            REGISTER: self.register_tokens_file,
            PEER: self.peer_tokens_file,
            ADMIN: self.admin_tokens_file,
        }

    def enabled(self) -> bool:
        return any(self.files().values()) or bool(self.member_key_file or self.member_trust_file)


class TlsSection(Section):
    """Server TLS; mutual TLS when client_ca_file is set."""

    cert_file: str = Field(default="")
    """PEM server certificate chain; TLS is on when set."""
    key_file: str = Field(default="")
    """PEM private key of the server certificate."""
    client_ca_file: str = Field(default="")
    """PEM CA that signs client certificates; set to require mutual TLS."""
    health_port: int = Field(default=0, ge=0, le=65535)
    """Plaintext port serving only grpc.health.v1 (kubelet gRPC probes cannot speak TLS); 0 = off."""


class TokenAuth:
    """Decides, for one call, whether its bearer token grants the method's role."""

    def __init__(
        self,
        generate: TokenFile | set[str],
        admin: TokenFile | set[str],
        relay: TokenFile | set[str] | None = None,
        register: TokenFile | set[str] | None = None,
        peer: TokenFile | set[str] | None = None,
    ) -> None:
        roles = ((generate, GENERATE), (relay or set(), RELAY), (register or set(), REGISTER), (peer or set(), PEER))
        self._files = [(_as_file(t), role) for t, role in roles]
        self._files.append((_as_file(admin), ADMIN))
        self._tenants: list[tuple[TokenFile, str, str]] = []
        """(tokens, role, tenant) of every tenant's token files (add_tenant)."""
        self._ambiguous: set[bytes] = set()
        self._member_check: Callable[[str], bool] | None = None
        self._grants: list[TokenFile] = []
        """auth.grant_tokens_file's: relay grants' keys derive from them, and they grant no role."""

    @classmethod
    def from_config(cls, auth: AuthSection, tenants: Iterable[tuple[str, Mapping[str, str]]] = ()) -> TokenAuth | None:
        """The server's token check; `tenants` (a proxy's) are (name, {role: token file}) pairs."""
        if not auth.enabled():
            return None
        files = {role: TokenFile(path, setting=f"auth.{role}_tokens_file") for role, path in auth.files().items()}
        token_auth = cls(files[GENERATE], files[ADMIN], files[RELAY], files[REGISTER], files[PEER])
        if auth.grant_tokens_file:
            token_auth._grants.append(TokenFile(auth.grant_tokens_file, setting="auth.grant_tokens_file"))
        for index, (tenant, by_role) in enumerate(tenants):
            for role, path in by_role.items():
                if path:
                    setting = f"tenants[{index}].{role}_tokens_file"
                    token_auth.add_tenant(tenant, role, TokenFile(path, setting=setting))
        return token_auth

    def add_tenant(self, tenant: str, role: str, tokens: TokenFile | set[str]) -> None:
        """Accept `tokens` with `role` (GENERATE or PUBLISH) for `tenant` only."""
        if role not in (GENERATE, PUBLISH):
            raise ValueError(f"a tenant's tokens have the generate or publish role, not {role}")
        self._tenants.append((_as_file(tokens), role, tenant))

    def accept_member(self, token: str) -> None:
        """Accept `token` (this replica's own member token) with the `member` role."""
        self._files.insert(0, (_as_file({token}), MEMBER))

    def accept_signed_members(self, check: Callable[[str], bool]) -> None:
        """Accept a token `check` finds valid (runtime.members.MemberCheck: a proxy's signature of
        this replica's own address) with the `member` role."""
        self._member_check = check

    def admin_digests(self) -> list[bytes]:
        """sha256 digests of the tokens the keys of relay grants derive from: the admin tokens now
        valid and auth.grant_tokens_file's."""
        grants = [d for tokens in self._grants for d in tokens.current()]
        return [d for tokens, role in self._files if role == ADMIN for d in tokens.current()] + grants

    def role(self, metadata) -> str | None:
        """The role of a call's bearer token (None without a valid one); checked already by the
        interceptor, so a handler asks this only for what a method's role cannot express."""
        grant = self.grant(metadata)
        return grant.role if grant is not None else None

    def grant(self, metadata) -> Grant | None:
        """The role and tenant of a call's token (None without a valid one)."""
        header = next((v for k, v in metadata or () if k == "authorization"), None)
        token = presented_token(header)
        return self._grant_of(token) if token else None

    def check(self, method: str, metadata) -> None:
        """Raise Unauthenticated or PermissionDenied; return when the call may proceed."""
        if not method.startswith(PROTECTED_PREFIX):
            return
        needed = METHOD_ROLES.get(method)
        short = method.rsplit("/", 1)[-1]
        if needed is None:
            raise PermissionDenied(f"{short} has no role assigned on this server; refusing it", reason=Reason.NO_ROLE)
        header = next((v for k, v in metadata or () if k == "authorization"), None)
        also = ((PEER,) if method in PEER_METHODS else ()) + ((MEMBER,) if method in MEMBER_METHODS else ())
        also += (PUBLISH,) if method in PUBLISH_METHODS else ()
        self.require(needed, header, short, also=also)
        if method in PEER_ONLY and self.role(metadata) != PEER:
            why = f"{short} is sent by peer proxies only, with a peer token (auth.peer_tokens_file here)"
            raise PermissionDenied(why, reason=Reason.WRONG_ROLE)

    def require(self, needed: str, header: str | bytes | None, what: str, also: tuple[str, ...] = ()) -> None:
        """Raise Unauthenticated or PermissionDenied unless the `authorization` header's bearer
        token has the `needed` role, or one of `also` (the HTTP door asks this for its routes, too)."""
        if not header:
            raise Unauthenticated(
                f"{what} needs a bearer token: send `authorization: Bearer <token>` (the CLI's --token-file)",
                reason=Reason.NO_TOKEN,
            )
        token = presented_token(header)
        grant = self._grant_of(token) if token else None
        if grant is None:
            raise Unauthenticated("the bearer token is not valid on this server", reason=Reason.BAD_TOKEN)
        role = grant.role
        if role == PUBLISH and needed == GENERATE:
            return  # publish: all that generate may
        if role not in (needed, ADMIN, *also):
            raise PermissionDenied(
                f"{what} needs the admin role{'' if needed == ADMIN else f' (or {needed})'}; this token has the {role} role",
                reason=Reason.WRONG_ROLE,
            )

    def _grant_of(self, token: str) -> Grant | None:
        if self._member_check is not None and self._member_check(token):
            return Grant(MEMBER)
        presented = digest(token)  # equal-length digests: neither content nor length leaks
        found = None
        for tokens, role in self._files:  # admin last: a token in several files has the widest role
            for known in tokens.current():  # compare every token in constant time, no early exit
                if hmac.compare_digest(known, presented):
                    found = role if found != ADMIN else ADMIN
        tenants: dict[str, str] = {}
        for tokens, role, tenant in self._tenants:
            for known in tokens.current():
                if hmac.compare_digest(known, presented):
                    tenants[tenant] = PUBLISH if PUBLISH in (role, tenants.get(tenant)) else role
        if not tenants:
            return Grant(found) if found else None
        if len(tenants) > 1 or found:  # a token maps to at most one tenant: refused, never guessed
            if presented not in self._ambiguous and len(self._ambiguous) < 1024:
                self._ambiguous.add(presented)
                why = "refused this token; list it in one tenant's files only, or in the fleet's"
                log.error("token_in_several_tenants", tenants=sorted(tenants), fleet_role=found or "", action=why)
            return None
        ((tenant, role),) = tenants.items()
        return Grant(role, tenant)


class Grant(NamedTuple):
    """What a valid token may do: its role, and its tenant ("" = the fleet's, as without tenants)."""

    role: str
    tenant: str = ""


def caller_role(auth: TokenAuth | None, context) -> str:
    """The role of the call in `context`: admin where auth is off (anyone may do anything)."""
    if auth is None:
        return ADMIN
    return auth.role(context.invocation_metadata()) or GENERATE


def require_stage_only(role: str, stage_only: bool) -> None:
    """A `relay` token stages pushes only: what it sends is served once an admin commits it. A
    `peer` token pushes only a peer's copy to a proxy (`require_peer`), never to a replica."""
    if role == RELAY and not stage_only:
        raise PermissionDenied(
            "a relay token may only stage a push (stage_only, as a relay hop sends it); "
            "serving, committing and pushing for good need an admin token",
            reason=Reason.WRONG_ROLE,
        )
    if role == PEER:
        raise PermissionDenied(
            "a peer token only shares versions between peer proxies (with the x-rollwire-peer marker); "
            "publishing a version needs an admin token (or a tenant's publish token, at a proxy)",
            reason=Reason.WRONG_ROLE,
        )


def require_peer(auth: TokenAuth | None, role: str) -> None:
    """The peer marker (a proxy's spool copy, never fanned out) is honoured from the `peer`
    role only (the caller's `role`), so no admin can make one proxy's spool diverge from the
    fleet's; from anyone where auth is off, as every call is."""
    if auth is not None and role != PEER:
        raise PermissionDenied(
            "only a peer proxy's token (auth.peer_tokens_file here, peering.token_file there) may mark a push as a "
            "peer's copy; push without the x-rollwire-peer metadata to publish a version",
            reason=Reason.WRONG_ROLE,
        )


def _as_file(tokens: TokenFile | set[str]) -> TokenFile:
    if isinstance(tokens, TokenFile):
        return tokens
    fixed = TokenFile("")
    fixed.digests = [digest(t) for t in tokens]
    return fixed


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


def interceptors(token_auth: TokenAuth | None) -> list[grpc.aio.ServerInterceptor]:
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


def is_loopback(host: str) -> bool:
    """True when `host` (an IP literal or a name) reaches only this machine (a bind check at
    start, so a blocking lookup is fine here)."""
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    if (ip := parse_ip(host)) is not None:
        return ip.is_loopback
    try:
        infos = socket.getaddrinfo(host, None)
    except (OSError, UnicodeError):
        return False
    ips = [parse_ip(str(info[4][0])) for info in infos]
    return bool(ips) and all(ip is not None and ip.is_loopback for ip in ips)


_warned: set[tuple[str, str, int]] = set()


def warn_if_exposed(role: str, host: str, port: int, auth: AuthSection, tls: TlsSection, metrics_port: int = 0) -> str:
    """Warn (structlog and plain stderr, once) when a non-loopback bind lacks auth or TLS.

    Returns the sentence printed, or "" when the bind is safe enough to stay quiet.
    """
    if is_loopback(host) or (role, host, port) in _warned:
        return ""
    no_auth = not auth.enabled()
    no_tls = not tls.cert_file
    if not (no_auth or no_tls):
        return ""
    _warned.add((role, host, port))
    risks = []
    if no_auth:
        risks.append(
            "without auth: anyone who can reach it can generate"
            + (", push adapters and register or drain replicas" if role == "proxy" else " and push adapters")
        )
    if no_tls:
        risks.append(
            "without TLS: prompts, completions, adapters"
            + ("" if no_auth else " and bearer tokens")
            + " cross the network in clear text"
        )
    fixes = []
    if no_auth:
        fixes.append("set auth.generate_tokens_file and auth.admin_tokens_file")
    if no_tls:
        fixes.append("set tls.cert_file and tls.key_file")
    metrics = (
        f" Its Prometheus port {metrics_port} is plain HTTP without auth on the same address (counters only);"
        " keep it behind a network policy."
        if metrics_port
        else ""
    )
    sentence = (
        f"rollwire {role} listens on {host}:{port}, which other machines can reach, "
        + "; ".join(risks)
        + ". "
        + " and ".join(fixes).capitalize()
        + " (docs/deploy.md, Security defaults), or bind host=127.0.0.1."
        + metrics
    )
    log.warning("insecure_bind", role=role, host=host, port=port, auth=not no_auth, tls=not no_tls, message=sentence)
    print(f"WARNING: {sentence}", file=sys.stderr, flush=True)
    return sentence


def caller_identity(metadata, peer: str, auth: bool) -> str:
    """A caller's identity for per-client limits and session scoping: with auth on, the bearer
    token's (a hash prefix, never the token); otherwise the peer's host without its port
    ("ipv4:10.0.0.5:41234" -> "ipv4:10.0.0.5")."""
    if auth:
        token = presented_token(next((v for k, v in metadata or () if k == "authorization"), None))
        if token:
            return "token:" + hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    peer = peer or "unknown"
    scheme, _, rest = peer.partition(":")
    if scheme in ("ipv4", "ipv6") and ":" in rest:
        return f"{scheme}:{rest.rsplit(':', 1)[0]}"
    return peer
