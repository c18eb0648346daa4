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

Signed member tokens (audit 2026-12-07 S6: with the fleet key every replica could mint every other
replica's token): the proxy holds an Ed25519 key (`upstream.member_signing_key_file`) and dials every
member, static and discovered ones too, with `rwm2.KEY_ID.SIG`, its signature of the member's
HOST:PORT; a replica holds only the proxies' public keys (`auth.member_trust_file`) and accepts the
token of its own advertised address (`MemberCheck`), so no replica, nor anyone who stole one's files,
can mint a token another replica accepts. A replica with a trust file accepts no HMAC member token:
its fleet key then only proves its address at registration.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
from collections import OrderedDict

import grpc

from rollwire.common.secrets import SecretFileError, read_secret_bytes
from rollwire.common.signing import KeyFileError, SigningKey, TrustedKeys

TOKEN_PREFIX = "rwm1."
SIGNED_PREFIX = "rwm2."
"""A signed member token: `rwm2.KEY_ID.SIGNATURE`, the proxy's Ed25519 signature of the member's address."""
_SIGNED_CONTEXT = b"rollwire member token v2\0"
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


def signed_member_token(key: SigningKey, address: str) -> str:
    """The proxy's signed bearer token for the member at `address` (HOST:PORT, as it dials it)."""
    signature = key.private.sign(_SIGNED_CONTEXT + address.encode())
    return f"{SIGNED_PREFIX}{key.key_id}.{base64.urlsafe_b64encode(signature).decode().rstrip('=')}"


def read_signing_key(path: str, setting: str) -> SigningKey | None:
    """The proxy's member signing key in `path` (`rollwire keys generate`); None when `path` is
    empty; SystemExit naming the setting for a file that is not one."""
    if not path:
        return None
    try:
        return SigningKey.load(path)
    except (KeyFileError, OSError) as exc:
        raise SystemExit(f"{setting} is {path!r}: {exc}") from None


def read_trusted(path: str, setting: str) -> TrustedKeys | None:
    """A replica's trusted proxy keys in `path` (a trust file, docs/security.md); None when empty."""
    if not path:
        return None
    try:
        return TrustedKeys.load(path)
    except (KeyFileError, OSError) as exc:
        raise SystemExit(f"{setting} is {path!r}: {exc}") from None


class MemberCheck:
    """A replica's check of signed member tokens: valid when a trusted key signed this very
    replica's advertised address. It holds public keys only, so it can verify but never mint.
    Tokens found valid are remembered (a few, least recently used forgotten): one verification
    per connection's token, not per call."""

    KEEP = 16

    def __init__(self, trusted: TrustedKeys, address: str) -> None:
        self.trusted, self.message = trusted, _SIGNED_CONTEXT + address.encode()
        self._valid: OrderedDict[str, None] = OrderedDict()

    def __call__(self, token: str) -> bool:
        if not token.startswith(SIGNED_PREFIX):
            return False
        if token in self._valid:
            self._valid.move_to_end(token)
            return True
        key_id, _, text = token[len(SIGNED_PREFIX) :].partition(".")
        public = self.trusted.keys.get(key_id)
        try:
            signature = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        except (binascii.Error, ValueError):
            return False
        if public is None or len(signature) != 64:
            return False
        from cryptography.exceptions import InvalidSignature

        try:
            public.verify(signature, self.message)
        except InvalidSignature:
            return False
        self._valid[token] = None
        while len(self._valid) > self.KEEP:
            self._valid.popitem(last=False)
        return True


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
