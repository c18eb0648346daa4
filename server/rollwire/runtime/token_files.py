"""Token files: the bearer tokens of one role, one per line, re-read while a server runs.

Kubernetes mounts Secrets as files and rotates them by swapping a symlink, so a server reads
its token files through the one secret-file reader (rollwire.common.secrets) at start (a bad
file stops it) and again when one changes: `TokenFile.current()` checks the file's metadata at
most every RELOAD_INTERVAL_S (one os.stat, cheap enough for the request path) and re-reads it
when that changed or REREAD_INTERVAL_S passed. A new version that cannot be read, is larger
than MAX_TOKEN_FILE_BYTES, is not UTF-8 or holds no token keeps the tokens the file held
(logged once per distinct reason), so a bad rotation never opens or closes a server. Only
sha256 digests of the tokens are kept.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import time

from rollwire.common.secrets import SecretFileError, read_secret_file
from rollwire.runtime.logs import get_logger

log = get_logger(__name__)
RELOAD_INTERVAL_S = 1.0  # how often a token file's metadata is checked, at most
REREAD_INTERVAL_S = 10.0  # a file is re-read this often even when its metadata looks unchanged
MAX_TOKEN_FILE_BYTES = 1 << 20
TOKEN_FILL = "put a token in it, one per line"


def parse_tokens(text: str) -> set[str]:
    """Tokens in a file's text, one per line; blank lines and # comments are ignored."""
    return {line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")}


def read_tokens(path: str, setting: str = "the token file") -> set[str]:
    """Tokens in a file, one per line; blank lines and # comments are ignored.

    A file that cannot be read, is not UTF-8 or holds no token stops the process with a
    sentence naming `setting` (the config key that names the file) and the path.
    """
    if not path:
        return set()
    try:
        return parse_tokens(_read_token_text(path, setting))
    except SecretFileError as exc:
        raise SystemExit(str(exc)) from None


def presented_token(header: str | bytes | None) -> str | None:
    """The token an `authorization` header presents: `Bearer TOKEN`, or `Basic` whose password
    is the token (what `requests` and `aiohttp` send for a URL `http://USER:TOKEN@host`, so a
    client that sends no header of its own, TRL's, carries it in its base URL); the user part
    is ignored. None for no header, another scheme or a Basic value that does not decode."""
    if not header:
        return None
    text = header.decode("latin-1") if isinstance(header, bytes) else str(header)
    scheme, _, value = text.strip().partition(" ")
    if scheme.lower() == "bearer":
        return value.strip() or None
    if scheme.lower() != "basic":
        return None
    try:
        pair = base64.b64decode(value.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    _user, colon, password = pair.partition(":")
    return password if colon and password else None


def digest(token: str) -> bytes:
    """What is kept of a token: its sha256 (compared in constant time, never logged)."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


class TokenFile:
    """The tokens of one file, re-read when it changes; a bad new version keeps the old tokens.

    `current()` costs one os.stat at most every `interval` seconds (and a read of the small file
    when its inode, size or mtime changed, or `reread` seconds passed), so it may run on the
    event loop. Kubernetes rotates a mounted Secret by swapping a symlink: stat follows it.
    """

    def __init__(
        self,
        path: str,
        interval: float = RELOAD_INTERVAL_S,
        reread: float = REREAD_INTERVAL_S,
        setting: str = "the token file",
    ) -> None:
        self.path, self.interval, self.reread, self.setting = path, interval, reread, setting
        self.digests: list[bytes] = []
        self._signature: tuple | None = None
        self._text: str | None = None
        self._checked = self._read_at = 0.0
        self._error = ""
        if path:
            self._signature = self._stat()
            try:
                self._text = _read_token_text(path, setting)
            except SecretFileError as exc:
                raise SystemExit(str(exc)) from None  # at start, a bad file is fatal
            self.digests = [digest(t) for t in parse_tokens(self._text)]
            self._checked = self._read_at = time.monotonic()

    def _stat(self) -> tuple | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def current(self) -> list[bytes]:
        """sha256 digests of the valid tokens, reloading the file first when it is due."""
        if self.path:
            now = time.monotonic()
            if now - self._checked >= self.interval:
                self._checked = now
                self.refresh(now)
        return self.digests

    def refresh(self, now: float | None = None) -> None:
        """Re-read the file when its metadata changed or `reread` passed; a file that cannot be
        read, is too large, is not UTF-8 or holds no token keeps the previous tokens (logged once
        per distinct reason)."""
        now = time.monotonic() if now is None else now
        signature = self._stat()
        if signature == self._signature and signature is not None and now - self._read_at < self.reread:
            return
        try:
            text = _read_token_text(self.path, self.setting)
        except SecretFileError as exc:
            reason = str(exc)
            if reason != self._error:
                log.error(
                    "token_file_reload_failed",
                    path=self.path,
                    reason=reason,
                    action="kept the previous tokens; fix the file and they reload",
                )
            self._error = reason
            return
        self._read_at, self._signature = now, signature
        if text == self._text and not self._error:
            return
        tokens = parse_tokens(text)
        self.digests = [digest(t) for t in tokens]
        self._text, self._error = text, ""
        log.info("token_file_reloaded", path=self.path, tokens=len(tokens))


def _read_token_text(path: str, setting: str) -> str:
    """A token file's text through the one secret-file reader, bounded by MAX_TOKEN_FILE_BYTES;
    a file with no token in it (blank lines and comments only) is refused like an empty one."""
    text = read_secret_file(path, setting, fill=TOKEN_FILL, limit=MAX_TOKEN_FILE_BYTES)
    if not parse_tokens(text):
        raise SecretFileError(f"{setting} is {path!r}, which holds no token; {TOKEN_FILL}")
    return text
