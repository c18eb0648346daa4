"""Chat prompts bounded before they are rendered or tokenized (audit A2).

The door renders and tokenizes a chat in the proxy's process; unbounded, one request held the
GIL for seconds and stalled every gRPC and HTTP caller of the proxy.

Invariants:
- a chat's text (every string in its messages, tools and chat_template_kwargs, keys included)
  is at most `cap` UTF-8 bytes: the fleet's max_prompt_tokens x PROMPT_BYTES_PER_TOKEN, as a
  replica bounds a text prompt; it is counted before any render, and a larger chat is a 400
  naming the limit;
- at most http.max_tokenizing chats are rendered and tokenized at once, each on a worker
  thread, and a slot is freed only when its thread ends (a caller that left frees nothing
  early); the tokenizer encodes with the GIL released (ChatTokenizer.encode), and builds ids
  only for a prompt within max_prompt_tokens;
- one client has at most http.tokenizing_bytes_per_client bytes of chat text waiting for or
  in tokenization (its first chat is always taken); beyond it a 429 (CLIENT_LIMIT).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

from rollwire.common.errors import InvalidArgument, ResourceExhausted
from rollwire.common.reasons import Reason
from rollwire.proxy.config import HttpSection
from rollwire.serving.config import PROMPT_BYTES_PER_TOKEN

T = TypeVar("T")
UNKNOWN_PROMPT_TOKENS = 4096
"""The prompt tokens assumed before any replica reported its limits (a replica's default max_prompt_tokens)."""


def text_bytes(value: Any, cap: int) -> int:
    """UTF-8 bytes of the strings in `value` (JSON: dicts, lists, strings, numbers), keys
    included, every other item counted as one byte; the count stops once it passes `cap`, so
    the walk is bounded by the cap, not by the body."""
    total, stack = 0, [value]
    while stack and total <= cap:
        item = stack.pop()
        if isinstance(item, str):
            # chars <= UTF-8 bytes <= 4 x chars: the length alone settles most strings
            total += len(item) if len(item) > cap else len(item.encode("utf-8", "surrogatepass"))
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
            total += 1
        else:
            total += 1
    return total


class PromptGate:
    """The door's bounds on chat rendering: the size cap, the tokenizing slots and each
    client's bytes in tokenization."""

    def __init__(self, http: HttpSection, retry_after_s: float) -> None:
        self.per_client = http.tokenizing_bytes_per_client
        self.retry_after_s = retry_after_s
        self.slots = asyncio.Semaphore(http.max_tokenizing)
        self.pending: Counter[str] = Counter()

    @staticmethod
    def check_size(chat: Any, max_prompt_tokens: int) -> int:
        """The chat's text bytes, or a 400 when they exceed what a prompt may have."""
        tokens = max_prompt_tokens or UNKNOWN_PROMPT_TOKENS
        cap = tokens * PROMPT_BYTES_PER_TOKEN
        size = text_bytes(chat, cap)
        if size > cap:
            raise InvalidArgument(
                f"the chat's messages, tools and chat_template_kwargs hold over {cap} bytes of text "
                f"({PROMPT_BYTES_PER_TOKEN} bytes for each of the {tokens} tokens a prompt may have here); shorten "
                "them, or send token ids to /v1/completions",
                reason=Reason.PROMPT_TOO_LONG,
            )
        return size

    async def run(self, client: str, size: int, work: Callable[[], T]) -> T:
        """`work` on a worker thread once a slot is free, counted against `client`'s bytes."""
        if self.pending[client] and self.pending[client] + size > self.per_client:
            raise ResourceExhausted(
                f"this client already has {self.pending[client]} bytes of chat text waiting to be tokenized; the "
                f"proxy takes at most {self.per_client} (http.tokenizing_bytes_per_client): wait for its answers",
                reason=Reason.CLIENT_LIMIT,
                retry_after_s=self.retry_after_s,
            )
        self.pending[client] += size
        try:
            await self.slots.acquire()
        except BaseException:
            self._done(client, size)
            raise
        future = asyncio.get_running_loop().run_in_executor(None, work)

        def finished(_: asyncio.Future) -> None:
            self.slots.release()
            self._done(client, size)

        future.add_done_callback(finished)  # the thread's end, even when the caller left first
        return await asyncio.shield(future)

    def _done(self, client: str, size: int) -> None:
        self.pending[client] -= size
        if self.pending[client] <= 0:
            del self.pending[client]
