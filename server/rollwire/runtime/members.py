"""Member credentials: what a proxy dials a self-registered replica with, and how a replica proves its address.

A fleet key (one secret file: the proxy's `upstream.member_key_file`, each replica's
`auth.member_key_file`) derives one bearer token per member address, HMAC(key, "HOST:PORT"),
and one proof per challenge, HMAC(key, address + nonce). Invariants:
- a replica accepts the member token of its own advertised address only (`registration.advertise`,
  else host:port), with the `member` role: Generate, GetStatus, PushAdapter and CommitAdapter on
  that replica and nothing else; a proxy never accepts one. So a process that registers
  host:OTHERPORT receives a token that is good only at host:OTHERPORT, i.e. on itself;
- the proxy never sends its admin token to a member that registered itself with a register token
  (`MemberToken` swaps it for the member's token on every call, relay streams included);
- a register token registers an address only when the process listening there proves it holds the
  fleet key and advertises that address: the proxy calls it back (GetStatus with CHALLENGE_KEY) and
  checks the PROOF_KEY it answers with. Neither the token nor the key is ever logged.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

import grpc

from rollwire.common.secrets import SecretFileError, read_secret_bytes

TOKEN_PREFIX = "rwm1."
CHALLENGE_KEY = "x-rollwire-member-challenge"
PROOF_KEY = "x-rollwire-member-proof"
_TOKEN_CONTEXT = b"rollwire member token v1\0"
_PROOF_CONTEXT = b"rollwire member proof v1\0"
MIN_KEY_BYTES = 16


def read_member_key(path: str, setting: str) -> bytes | None:
    """The fleet key in `path` (its stripped bytes); None when `path` is empty. A file that
    cannot be read or holds fewer than MIN_KEY_BYTES bytes stops the process with a sentence."""
    if not path:
        return None
    hint = f"a fleet key needs at least {MIN_KEY_BYTES} bytes (e.g. `openssl rand -hex 32`)"
    try:
        key = read_secret_bytes(path, setting, fill=hint)
    except SecretFileError as exc:
        raise SystemExit(str(exc)) from None
    if len(key) < MIN_KEY_BYTES:
        raise SystemExit(
            f"{setting} is {path!r}, which holds {len(key)} bytes; a fleet key needs at least {MIN_KEY_BYTES} "
            "(e.g. `openssl rand -hex 32`)"
        )
    return key


def member_token(key: bytes, address: str) -> str:
    """The bearer token of the member at `address` (HOST:PORT, exactly as registered)."""
    return TOKEN_PREFIX + hmac.new(key, _TOKEN_CONTEXT + address.encode(), hashlib.sha256).hexdigest()


def member_proof(key: bytes, address: str, nonce: str) -> str:
    """What the member advertising `address` answers to the challenge `nonce`."""
    message = _PROOF_CONTEXT + address.encode() + b"\0" + nonce.encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def new_challenge() -> str:
    return secrets.token_hex(16)


def proof_matches(key: bytes, address: str, nonce: str, answer: str) -> bool:
    return hmac.compare_digest(member_proof(key, address, nonce), answer)


class MemberToken(
    grpc.aio.UnaryUnaryClientInterceptor,
    grpc.aio.UnaryStreamClientInterceptor,
    grpc.aio.StreamUnaryClientInterceptor,
    grpc.aio.StreamStreamClientInterceptor,
):
    """A channel interceptor for one member: every call's `authorization` that is the proxy's own
    (`replaced`, its upstream admin bearer) leaves as the member's token instead, so no code path
    (health, status, rollouts, catch-up, relay trees) can hand a self-registered member the admin
    token. Other credentials (the relay token, which can only stage granted bytes) pass unchanged."""

    def __init__(self, token: str, replaced: str) -> None:
        self.token, self.replaced = f"Bearer {token}", replaced

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = [
            (k, self.token if k == "authorization" and v == self.replaced else v) for k, v in (details.metadata or ())
        ]
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, grpc.aio.Metadata(*metadata), details.credentials, details.wait_for_ready
        )

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)

    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)

    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)
