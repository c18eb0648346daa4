"""Incremental detokenizing, shared by every engine: the text each new token adds.

`TextStream` wraps `tokenizers`' DecodeStream, which decodes only a short window of
recent tokens per step, so a sample's text costs O(1) per token instead of decoding the
whole sample again (O(n^2) over a sample). Rules every engine's text follows:
- the deltas of a sample concatenate to the tokenizer's own decode of its tokens with
  special tokens skipped (`tokenizers`-level: no clean_up_tokenization_spaces);
- a delta is released only once it is complete: a token that ends inside a multi-byte
  character adds "" and the character comes with the token that completes it;
- ids the tokenizer does not know (a model whose vocabulary is padded past the
  tokenizer's) add nothing.
If DecodeStream cannot extend its text (a decoder whose output changes earlier characters
when a token arrives), that token falls back to decoding the whole sample once, and the
window restarts after it; text already sent is never taken back.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from rollwire.common.errors import FailedPrecondition
from rollwire.runtime.logs import get_logger

log = get_logger(__name__)


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

    `tail` keeps the last `keep` characters sent, which is all a stop-string check needs."""

    def __init__(self, tokenizer: Tokenizer, keep: int = 0) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self._ids: list[int] = []
        self._sent = 0  # characters released so far
        self._keep = keep
        self.tail = ""

    def add(self, ids: int | list[int]) -> str:
        """The text that `ids` (the sample's next tokens) complete; "" while a character is open."""
        new = [ids] if isinstance(ids, int) else list(ids)
        self._ids.extend(new)
        try:
            delta = self._stream.step(self._tokenizer, new) or ""
        except Exception as exc:  # DecodeStream's InvalidPrefix: its window no longer extends its text
            delta = self._resync(exc)
        self._sent += len(delta)
        if self._keep:
            self.tail = (self.tail + delta)[-self._keep :]
        return delta

    def _resync(self, exc: Exception) -> str:
        full = self._tokenizer.decode(self._ids, skip_special_tokens=True)
        self._stream = DecodeStream(ids=self._ids, skip_special_tokens=True)
        if full.endswith("\ufffd") or len(full) <= self._sent:
            delta = ""
        else:
            delta = full[self._sent :]
        log.info("detokenize_resync", error=str(exc)[:200], tokens=len(self._ids))
        return delta
