"""Incremental detokenizing, shared by every engine: the text each new token adds.

`TextStream` decodes only a window of recent tokens per step (from the last point where the
text was complete), so a sample's text costs O(1) per token instead of decoding the whole
sample again (O(n^2) over a sample). Rules every engine's text follows:
- the deltas of a finished sample (its last one `finish`'s) concatenate to exactly the
  tokenizer's own decode of its tokens with special tokens skipped (`tokenizers`-level: no
  clean_up_tokenization_spaces), vLLM's `skip_special_tokens` rule: `decode(ids,
  skip_special_tokens=True)`;
- after k tokens, the text sent is their decode less its trailing replacement characters
  (U+FFFD): a token that ends inside a multi-byte character adds "" and the character comes
  with the token that completes it; a sample that ends there (its last byte-level token opened
  a character no token completed, or bytes that are no UTF-8 at all) gets the decode's
  replacement characters from `finish`, so nothing the decode holds is left out;
- that text is a function of the k tokens alone, however they were fed (one at a time, in
  chunks, or all at once to prime a resumed sample): so a replica that continues another's
  sample, primed with its tokens, goes on exactly where the client's text stopped;
- ids the tokenizer does not know (a model whose vocabulary is padded past the
  tokenizer's) add nothing.
The window is exact where the text is complete: the decode of tokens after such a point does
not depend on the tokens before it (byte-level BPE, Metaspace, WordPiece, byte fallback). A
decoder for which that fails (the window's text no longer extends what it decoded before) costs
one decode of the whole sample at that token, and the window restarts there; text already sent
is never taken back.
"""

from __future__ import annotations

from tokenizers import Tokenizer

from rollwire.common.errors import FailedPrecondition
from rollwire.runtime.logs import get_logger

log = get_logger(__name__)

REPLACEMENT = "\ufffd"


def backend(tokenizer) -> Tokenizer:
    """The `tokenizers.Tokenizer` behind a Hugging Face fast tokenizer (or itself)."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    inner = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(inner, Tokenizer):
        raise FailedPrecondition(
            f"the model's tokenizer ({type(tokenizer).__name__}) has no `tokenizers` backend, which incremental "
            "detokenizing needs; give the model folder a tokenizer.json"
        )
    return inner


class TextStream:
    """The text of one sample, grown token by token (see the module docstring).

    `tail` keeps the last `keep` characters sent (and the whole of the latest delta), which is
    all a stop-string check needs."""

    def __init__(self, tokenizer: Tokenizer, keep: int = 0) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._start = 0  # the window: the ids from here are decoded at each step
        self._anchor = 0  # ids[start:anchor] decode to `_anchored`; the text is complete at both
        self._anchored = ""
        self._before = 0  # characters of the whole text before `anchor`
        self._sent = 0  # characters released so far (>= _before)
        self._sent_text: list[str] = []
        self._keep = keep
        self.tail = ""

    def add(self, ids: int | list[int]) -> str:
        """The text that `ids` (the sample's next tokens) complete; "" while a character is open."""
        self._ids.extend([ids] if isinstance(ids, int) else ids)
        window = self._decode(self._start)
        if not window.startswith(self._anchored):  # the decoder rewrote text before the anchor
            return self._resync()
        text = window[len(self._anchored) :]
        ready = text.rstrip(REPLACEMENT)
        delta = ready[self._sent - self._before :]
        if text and len(ready) == len(text):  # complete here, and not empty: move the window up
            self._start, self._anchor = self._anchor, len(self._ids)
            self._anchored = self._decode(self._start)
            self._before += len(text)
        return self._release(delta)

    def finish(self) -> str:
        """The rest of the sample's text once its last token is in: what the decode of all its
        tokens holds beyond the deltas sent (the replacement characters of a character left
        open; "" otherwise). One decode of the sample, once per sample."""
        full = self._tokenizer.decode(self._ids, skip_special_tokens=True)
        sent = "".join(self._sent_text)
        if not full.startswith(sent):
            log.error("detokenize_diverged", tokens=len(self._ids), sent=self._sent, decoded=len(full))
            return ""
        return self._release(full[self._sent :])

    def found(self, stops: list[str] | tuple[str, ...], delta: str) -> str | None:
        """The first stop string that the text ending with `delta` (the latest delta) holds in a
        place `delta` completed, or None: a stop string may end inside a multi-character delta,
        not only at its end."""
        if not delta:
            return None
        for stop in stops:
            if stop and stop in self.tail[max(0, len(self.tail) - len(delta) - len(stop) + 1) :]:
                return stop
        return None

    def _decode(self, start: int) -> str:
        return self._tokenizer.decode(self._ids[start:], skip_special_tokens=True)

    def _release(self, delta: str) -> str:
        if delta:
            self._sent += len(delta)
            self._sent_text.append(delta)
            if self._keep:
                self.tail = (self.tail + delta)[-(self._keep + len(delta)) :]
        return delta

    def _resync(self) -> str:
        full = self._tokenizer.decode(self._ids, skip_special_tokens=True)
        ready = full.rstrip(REPLACEMENT)
        log.info("detokenize_resync", tokens=len(self._ids))
        if len(ready) == len(full):  # complete: the window restarts here, one anchor of context before it
            self._start, self._anchor = self._anchor, len(self._ids)
            self._anchored, self._before = self._decode(self._start), len(full)
        return self._release(ready[self._sent :])
