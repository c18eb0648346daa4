"""How one rollwire process dials another: the one settings section and the one credentials function.

Five links dial another rollwire server: the proxy to its replicas (`upstream`), the proxy to
its peer proxies (`peering`, each empty setting taken from `upstream`), a replica to its relay
children (`relay`), a replica to the proxy it registers with (`registration`) and the learner
to its target (`client`). Each is a DialSection under its own name and is read once, at start,
by `dial_credentials`: a file that cannot be read, a token file with no token, or a certificate
without its key stops the process with one sentence naming the setting. What comes back holds
bytes and a token only, so the servers build grpc.aio channels from it (serving/dial.py) and the
learner the SDK's TlsConfig. Token values are never logged (repr leaves them and keys out).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from pydantic import Field

from rollwire.runtime.config import Section
from rollwire.runtime.token_files import read_tokens

TLS_KEYS = ("ca_file", "cert_file", "key_file")


class DialSection(Section):
    """Dialling another rollwire server: TLS (off unless tls, ca_file or cert_file is set) and a bearer token."""

    renamed_keys: ClassVar[dict[str, str]] = {  # the learner's `client` and registration's CA, until issue 26
        "tls_ca_file": "ca_file",
        "tls_cert_file": "cert_file",
        "tls_key_file": "key_file",
        "tls_server_name": "server_name",
    }

    tls: bool = Field(default=False)
    """Dial over TLS (trusting the system roots unless ca_file is set)."""
    ca_file: str = Field(default="")
    """PEM roots that sign the server's certificate; implies tls."""
    cert_file: str = Field(default="")
    """PEM client certificate, for a server that requires mutual TLS; implies tls."""
    key_file: str = Field(default="")
    """PEM private key of cert_file."""
    server_name: str = Field(default="")
    """Name to check the server's certificate against when it differs from its host."""
    token_file: str = Field(default="")
    """File holding the bearer token sent on every call (the first, when it lists several); empty = none."""


@dataclass(frozen=True)
class DialCredentials:
    """What one link dials with: TLS material (tls False = plaintext) and a bearer token."""

    tls: bool = False
    root_certificates: bytes | None = None
    """PEM roots; None trusts the system roots."""
    certificate_chain: bytes | None = None
    private_key: bytes | None = field(default=None, repr=False)
    server_name: str = ""
    """Name override for the certificate check; empty = the target's host."""
    token: str = field(default="", repr=False)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The authorization metadata of every call (none without a token)."""
        return bearer(self.token)


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


def dial_credentials(
    section: DialSection, setting: str, inherit: tuple[DialSection, str] | None = None
) -> DialCredentials:
    """The credentials of the link configured as `setting` (e.g. "upstream"). With `inherit`
    (a section and its name), each empty setting of `section` is taken from that one. Raises
    SystemExit with a sentence naming the setting it cannot use."""

    def pick(name: str) -> tuple[str, str | bool]:
        for s, where in ((section, setting), *([inherit] if inherit else [])):
            if getattr(s, name):
                return f"{where}.{name}", getattr(s, name)
        return f"{setting}.{name}", getattr(section, name)

    (ca_key, ca), (cert_key, cert), (key_key, key), (token_key, token_file) = map(pick, (*TLS_KEYS, "token_file"))
    token, server_name = read_token(str(token_file), token_key), str(pick("server_name")[1])
    if bool(cert) != bool(key):
        raise SystemExit(f"{cert_key} and {key_key} go together: give both for mutual TLS")
    if not (pick("tls")[1] or ca or cert):
        return DialCredentials(False, server_name=server_name, token=token)
    files = [_read_pem(str(path), where) for where, path in ((ca_key, ca), (cert_key, cert), (key_key, key))]
    return DialCredentials(True, *files, server_name=server_name, token=token)


def read_token(path: str, setting: str) -> str:
    """The first token (in sorted order) of the token file `path`; "" when `path` is empty."""
    tokens = read_tokens(path, setting)
    return min(tokens) if tokens else ""


def _read_pem(path: str, setting: str) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise SystemExit(f"{setting} is {path!r}, which cannot be read: {exc.strerror}") from None
