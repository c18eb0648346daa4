"""What the transformers engine offers its prefix cache (prefix_cache.py): a prefilled row's
prompt KV, and a finished episode turn's, as a mixin beside MemoryRules and ScoreRules.

Invariant: only KV that matches its tokens exactly is stored (a row's real columns, checked
against the token count), so a later hit reuses exactly the keys and values of its prefix.
"""

from __future__ import annotations

import torch

from rollwire.generator.engines.embedded import kv_batch
from rollwire.generator.engines.embedded.prefix_cache import AdapterKey, PrefixCache
from rollwire.runtime.logs import get_logger

log = get_logger(__name__)


class PrefixRules:
    """What the transformers engine offers its prefix cache (a mixin, as MemoryRules and
    ScoreRules): a prefilled row's prompt KV, and a finished episode turn's."""

    prefix_cache: PrefixCache

    def _remember(self, key: AdapterKey, tokens: list[int], cache: object, mask: torch.Tensor, row: int) -> None:
        """Offer row `row`'s KV (exactly `tokens`' keys and values) to the prefix cache."""
        if not self.prefix_cache.enabled or len(tokens) < self.prefix_cache.settings.block_tokens:
            return
        keys, values = kv_batch.row_kv(cache, mask, row)
        if keys[0].shape[-2] != len(tokens):  # never store KV that does not match its tokens
            log.error("prefix_cache_mismatch", tokens=len(tokens), kv=int(keys[0].shape[-2]))
            return
        self.prefix_cache.store(key, tokens, keys, values)

    def _remember_finished(self, batch: kv_batch.Batch, finished: list[int]) -> None:
        """A finished one-sample group's prompt and tokens but the last (that one was sampled,
        never fed): what the next turn of its episode starts with. Rows that switched version
        (follow) are skipped: their KV mixes versions."""
        for i in finished:
            row = batch.rows[i]
            if row.group.req.n != 1 or (row.adapter, row.version) != (row.key[2], row.key[1]):
                continue
            self._remember(row.key, row.group.req.prompt_ids + row.tokens[:-1], batch.cache, batch.mask, i)
