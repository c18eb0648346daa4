"""The prefix KV cache's pure index (PrefixCache, issue 25) with a hand-driven clock: the
longest cached prefix is found exactly, and budget, TTL, a superseding version and unloads
evict entries with their cause counted."""

from __future__ import annotations

import torch

from rollwire.generator.engines.embedded.prefix_cache import PrefixCache, PrefixCacheSettings
from rollwire.generator.metrics import GeneratorMetrics


# -- the index alone ---------------------------------------------------------------------
def kv(n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer (2) keys and values of n tokens, [heads 1, n, head_dim 2]; value = position."""
    t = torch.arange(n, dtype=torch.float32)[None, :, None].repeat(1, 1, 2)
    return [t.clone(), t.clone()], [t.clone(), t.clone()]


def length(hit) -> int:
    assert hit is not None
    return hit.length


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_longest_cached_prefix_is_found_exactly_not_rounded_to_a_block():
    cache = PrefixCache(PrefixCacheSettings(max_tokens=1000, block_tokens=4))
    base = ("", 0, None)
    cache.store(base, list(range(10)), *kv(10))
    hit = cache.lookup(base, [*range(10), 50, 51])
    assert hit is not None and hit.length == 10
    assert [k.shape[-2] for k, _ in hit.layers()] == [10, 10]
    assert length(cache.lookup(base, [*range(6), 99, 98, 97])) == 6  # diverges inside the second block
    assert length(cache.lookup(base, list(range(10)))) == 9  # the last prompt token is always computed
    assert cache.lookup(base, [1, 2, 3, 4, 5]) is None  # not a prefix
    assert cache.lookup(("pol", 1, "h1"), [*range(10), 50]) is None  # another adapter's KV


def test_budget_ttl_supersede_and_unload_evict_with_their_cause():
    metrics, clock = GeneratorMetrics(), Clock()
    cache = PrefixCache(PrefixCacheSettings(max_tokens=40, ttl_s=10, block_tokens=4), metrics, clock)
    pol = ("pol", 1, "h1")
    assert cache.store(pol, list(range(8)), *kv(8))
    assert cache.store(pol, list(range(12)), *kv(12))  # extends the first: it replaces it
    assert len(cache) == 1 and cache.tokens == 12
    for i in range(5):  # a flood of distinct sequences: the oldest go, the total never exceeds the budget
        clock.now += 1
        assert cache.store(pol, [100 + i] * 12, *kv(12))
        assert cache.tokens <= 40 and cache.nbytes == cache.tokens * 2 * 2 * 2 * 4
    assert not cache.store(pol, list(range(41)), *kv(41))  # longer than the whole budget: never stored
    clock.now = 13.5  # the oldest remaining one (stored at 3) is now unused for longer than the TTL
    cache.lookup(pol, [1, 2, 3])
    assert len(cache) == 2
    cache.drop_handle("h1")
    assert len(cache) == 0 and cache.tokens == 0 and cache.nbytes == 0
    counts = {c: metrics.prefix_evictions.labels(c)._value.get() for c in ("superseded", "capacity", "ttl", "adapter")}
    assert counts == {"superseded": 1, "capacity": 3, "ttl": 1, "adapter": 2}
