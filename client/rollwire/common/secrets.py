"""Secrets kept in files (bearer tokens, API keys): read by one rule everywhere, so a missing,
unreadable or empty file is refused with the same sentence by every command. The value itself
is never put in a message or a log.
"""

from __future__ import annotations

from pathlib import Path


class SecretFileError(ValueError):
    """A secret's file cannot be read or is empty; the message names the setting and the file.
    Each caller raises it on as its own error (a usage error, a FailedPrecondition, ...)."""


def read_secret_file(path: str | Path, what: str) -> str:
    """The secret in file `path`, without surrounding white space; `what` names the setting
    (a flag or a config key) in the error."""
    try:
        value = Path(path).read_text().strip()
    except OSError as exc:
        raise SecretFileError(f"{what} is {str(path)!r}, which cannot be read: {exc.strerror}") from None
    if not value:
        raise SecretFileError(f"{what} is {str(path)!r}, which is empty; put the secret in it") from None
    return value
