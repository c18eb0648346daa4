"""The transformers engine's prefix KV cache: keys and values of token sequences it computed
recently, so a prompt that extends one of them is prefilled from its suffix only.

Who uses it: a session turn forwarded by the proxy, and an agent harness that resends the
whole history every turn, both send a prompt that extends the previous turn's prompt and
reply. The engine stores two kinds of entries (transformers_engine.py): every prefilled
prompt, and, for a group of one sample (a turn), its prompt plus the sample's tokens but the
last one (the last sampled token was never fed to the model, so it has no KV; the next
turn's prefill computes it as the first token of its suffix).

Invariants:
- An entry is keyed by the adapter selection that computed it (name, version and the
  registry's never-reused engine handle; the base model is its own key): KV depends on the
  LoRA weights, so a prompt never reuses KV computed under another adapter or version.
  Entries of an unloaded handle are dropped at once.
- The tokens held (the sum of the entries' lengths) never exceed `max_tokens`: an entry that
  does not fit alone is not stored, and least recently used entries are evicted to make room.
  Entries unused for `ttl_s` are evicted before each lookup and store.
- A hit reuses at most len(prompt) - 1 tokens: the prompt's last token is always computed, as
  its logits are the first sample's distribution.
- Everything here runs on the engine's worker thread only (no locks); the tensors are CPU
  copies, never views of the running batch's cache.

Matching (block-aligned chain hashing, then an exact extension): a sequence's full blocks of
`block_tokens` tokens are hashed as a chain (block j's hash covers blocks 0..j), and the
index maps each (adapter, chain hash) to the entry that last registered it. A lookup hashes
the prompt's full blocks (O(prompt) work, prompt/block dictionary probes), takes the longest
block that hits, checks the entry's tokens really equal the prompt's up to there (a hash
collision is a miss), then extends the match token by token inside that entry, so the reused
length is exact, not rounded down to a block. The index costs one dictionary slot per block
held. A store first drops entries of the same adapter that the new one extends (cause
`superseded`: a session's turn leaves one entry, not one per turn), and is skipped when an
entry already holds the whole sequence.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rollwire.generator.metrics import GeneratorMetrics

AdapterKey = tuple[str, int, str | None]
"""(adapter name, version, engine handle); ("", 0, None) is the base model."""

EVICTION_CAUSES = ("ttl", "capacity", "adapter", "superseded")


@dataclass(frozen=True)
class PrefixCacheSettings:
    """How much the prefix cache may hold and for how long (config: transformers.prefix_cache)."""

    max_tokens: int = 16384
    """Tokens of keys and values held at most, all entries together; 0 turns the cache off."""
    ttl_s: float = 300.0
    """An entry unused this long is evicted."""
    block_tokens: int = 16
    """Granularity of the hash index; sequences shorter than one block are not stored."""


@dataclass
class Entry:
    """The KV of `tokens` under one adapter: per layer, keys and values [heads, len, head_dim]."""

    key: AdapterKey
    tokens: list[int]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    last_used: float
    index_keys: list[Hashable] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.keys) + sum(t.nbytes for t in self.values)


@dataclass(frozen=True)
class Hit:
    """The first `length` tokens of a prompt, found in `entry`."""

    entry: Entry
    length: int

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (keys, values) [heads, length, head_dim] of the reused prefix (views of the entry)."""
        n = self.length
        return [(k[:, :n], v[:, :n]) for k, v in zip(self.entry.keys, self.entry.values, strict=True)]


class PrefixCache:
    """Entries in least-recently-used order, a hash index over their blocks, and the totals
    the budget is checked against (see the module docstring for the invariants)."""

    def __init__(
        self,
        settings: PrefixCacheSettings,
        metrics: GeneratorMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.clock = clock
        self._entries: OrderedDict[int, Entry] = OrderedDict()  # id(entry) -> entry, oldest use first
        self._index: dict[Hashable, Entry] = {}
        self.tokens = 0
        self.nbytes = 0

    @property
    def enabled(self) -> bool:
        return self.settings.max_tokens > 0

    def __len__(self) -> int:
        return len(self._entries)

    # -- lookups -----------------------------------------------------------------------
    def lookup(self, key: AdapterKey, prompt: list[int]) -> Hit | None:
        """The longest cached prefix of `prompt` under `key`, at most len(prompt) - 1 tokens;
        counted in the lookup metrics. A hit makes its entry the most recently used."""
        if not self.enabled:
            return None
        self._expire()
        hit = self._find(key, prompt, len(prompt) - 1)
        if self.metrics is not None:
            self.metrics.prefix_lookups.labels("hit" if hit else "miss").inc()
            if hit:
                self.metrics.prefix_hit_tokens.inc(hit.length)
        if hit:
            self._touch(hit.entry)
        return hit

    def _find(self, key: AdapterKey, tokens: list[int], limit: int) -> Hit | None:
        block = self.settings.block_tokens
        hashes = _chain(tokens[: max(limit, 0)], block)
        for j in range(len(hashes) - 1, -1, -1):
            entry = self._index.get((key, hashes[j]))
            covered = (j + 1) * block
            if entry is None or entry.tokens[:covered] != tokens[:covered]:
                continue  # absent, or a hash collision
            end = min(len(entry.tokens), limit)
            while covered < end and entry.tokens[covered] == tokens[covered]:
                covered += 1
            return Hit(entry, covered)
        return None

    # -- stores --------------------------------------------------------------------------
    def store(self, key: AdapterKey, tokens: list[int], keys: list[torch.Tensor], values: list[torch.Tensor]) -> bool:
        """Keep the KV of `tokens` (per layer [heads, len(tokens), head_dim], CPU tensors this
        cache may own). False when not stored: too short or too long for the budget, or an
        entry already holds the whole sequence (it is then made the most recently used)."""
        n = len(tokens)
        if not self.enabled or n < self.settings.block_tokens or n > self.settings.max_tokens:
            return False
        self._expire()
        while (found := self._find(key, tokens, n)) is not None:
            if found.length == n:
                self._touch(found.entry)
                return False
            if found.length < len(found.entry.tokens):
                break  # shares a prefix only: both stay
            self._remove(found.entry, "superseded")
        while self._entries and self.tokens + n > self.settings.max_tokens:
            self._remove(next(iter(self._entries.values())), "capacity")
        entry = Entry(key, list(tokens), keys, values, self.clock())
        hashes = _chain(entry.tokens, self.settings.block_tokens)
        entry.index_keys = [(key, h) for h in hashes]
        for k in entry.index_keys:
            self._index[k] = entry
        self._entries[id(entry)] = entry
        self.tokens += n
        self.nbytes += entry.nbytes
        self._publish()
        return True

    def drop_handle(self, handle: str | None) -> None:
        """Forget every entry computed under an engine handle being unloaded."""
        for entry in [e for e in self._entries.values() if e.key[2] == handle]:
            self._remove(entry, "adapter")

    # -- bookkeeping -------------------------------------------------------------------------
    def _touch(self, entry: Entry) -> None:
        entry.last_used = self.clock()
        self._entries.move_to_end(id(entry))

    def _expire(self) -> None:
        deadline = self.clock() - self.settings.ttl_s
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest.last_used >= deadline:
                return
            self._remove(oldest, "ttl")

    def _remove(self, entry: Entry, cause: str) -> None:
        del self._entries[id(entry)]
        for k in entry.index_keys:
            if self._index.get(k) is entry:
                del self._index[k]
        self.tokens -= len(entry.tokens)
        self.nbytes -= entry.nbytes
        if self.metrics is not None:
            self.metrics.prefix_evictions.labels(cause).inc()
        self._publish()

    def _publish(self) -> None:
        if self.metrics is not None:
            self.metrics.prefix_entries.set(len(self._entries))
            self.metrics.prefix_tokens.set(self.tokens)
            self.metrics.prefix_bytes.set(self.nbytes)


def _chain(tokens: list[int], block: int) -> list[int]:
    """Chained hashes of the full blocks of `tokens`: element j covers tokens[: (j + 1) * block]."""
    out: list[int] = []
    h = 0
    for start in range(0, len(tokens) - block + 1, block):
        h = hash((h, tuple(tokens[start : start + block])))
        out.append(h)
    return out
