"""Secrets kept in files (bearer tokens, API keys, the fleet key): read by one rule everywhere,
so a missing, unreadable, non-UTF-8 or empty file is refused with the same sentence by every
command and server. The value itself is never put in a message or a log.

`read_secret_bytes` is the one place a secret's file is opened; `read_secret_file` is its text.
The SDK's `--token-file`, an engine server's API key files (engines/served/files.py), the
servers' token files (runtime/security.py: one token a line, # comments) and the fleet key
(runtime/members.py) all read through it, a token file re-read while a server runs
(token_files.TokenFile.refresh) included: that one catches SecretFileError and keeps its old
tokens instead of failing.
"""

from __future__ import annotations

from pathlib import Path


class SecretFileError(ValueError):
    """A secret's file cannot be read, is not UTF-8 text or is empty; the message names the
    setting and the file. Each caller raises it on as its own error (a usage error, a
    FailedPrecondition, SystemExit, ...)."""


def read_secret_bytes(
    path: str | Path, what: str, *, fill: str = "put the secret in it", limit: int | None = None
) -> bytes:
    """The bytes in file `path`, without surrounding white space; `what` names the setting (a
    flag or a config key) in the error, `fill` says what an empty file should hold. With a
    `limit`, at most limit + 1 bytes are read, and a longer file is refused."""
    try:
        with open(path, "rb") as f:
            value = f.read() if limit is None else f.read(limit + 1)
    except OSError as exc:
        raise SecretFileError(f"{what} is {str(path)!r}, which cannot be read: {exc.strerror}") from None
    if limit is not None and len(value) > limit:
        raise SecretFileError(f"{what} is {str(path)!r}, which is larger than {limit} bytes") from None
    value = value.strip()
    if not value:
        raise SecretFileError(f"{what} is {str(path)!r}, which is empty; {fill}") from None
    return value


def read_secret_file(
    path: str | Path, what: str, *, fill: str = "put the secret in it", limit: int | None = None
) -> str:
    """The secret in file `path` as text, without surrounding white space (read_secret_bytes);
    a file that is not UTF-8 text is refused."""
    value = read_secret_bytes(path, what, fill=fill, limit=limit)
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise SecretFileError(f"{what} is {str(path)!r}, which is not UTF-8 text") from None
