"""The transformers engine's prefix KV cache (issue 25) on real replicas: reuse across turns
changes nothing but the work done, never crosses adapter versions, and stays within its budget.

Independent computation: the same turns on a replica whose cache is off (the whole prompt
prefilled every time); the work saved is read from the replicas' scraped counters and
checked against token counts the test computes itself; memory held is checked against the
bytes a token's keys and values take, computed from the model's config.json. The pure index:
tests/unit/generator/test_prefix_cache_index.py."""

from __future__ import annotations

import json
import random

import pytest
import torch
from support.processes import GENERATOR_ARGS, start_generator, wait_until
from support.wire import fingerprint, generate, make_adapter, metric_value, push

BUDGET = 600  # tokens the cached replica holds at most
TTL_S = 6.0
ENV = [7, 8, 9, 10, 11]  # the environment's tokens between two turns
P = "rollwire_generator_"


def length(hit) -> int:
    assert hit is not None
    return hit.length


# -- real replicas -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def replicas(tiny_model, workdir):
    """(cached, uncached): the same model and limits; only the prefix cache differs."""
    cached = start_generator(
        tiny_model,
        workdir,
        "cached",
        *GENERATOR_ARGS,
        "--set",
        f"transformers.prefix_cache.max_tokens={BUDGET}",
        "--set",
        f"transformers.prefix_cache.ttl_s={TTL_S}",
    )
    try:
        uncached = start_generator(
            tiny_model, workdir, "uncached", *GENERATOR_ARGS, "--set", "transformers.prefix_cache.max_tokens=0"
        )
    except BaseException:
        cached.stop()
        raise
    yield cached, uncached
    uncached.stop()
    cached.stop()


def counters(svc) -> dict[str, float]:
    text = svc.metrics()
    return {
        "prefill": metric_value(text, P + "prefill_tokens_total"),
        "hit_tokens": metric_value(text, P + "prefix_cache_hit_tokens_total"),
        "hits": metric_value(text, P + "prefix_cache_lookups_total", 'result="hit"'),
        "misses": metric_value(text, P + "prefix_cache_lookups_total", 'result="miss"'),
        "tokens": metric_value(text, P + "prefix_cache_tokens"),
        "bytes": metric_value(text, P + "prefix_cache_bytes"),
        "entries": metric_value(text, P + "prefix_cache_entries"),
        **{
            f"evicted_{c}": metric_value(text, P + "prefix_cache_evictions_total", f'cause="{c}"')
            for c in ("ttl", "capacity", "adapter", "superseded")
        },
    }


def delta(svc, before: dict[str, float]) -> dict[str, float]:
    return {k: v - before[k] for k, v in counters(svc).items()}


def prompt(seed: int, length: int = 40) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 100) for _ in range(length)]  # ids 0-2 are special tokens


def turn(svc, ids: list[int], adapter=None, **sampling):
    g = generate(svc.target, ids, n=1, adapter=adapter, max_new_tokens=12, ignore_eos=True, **sampling)
    return g.tokens[0], g.logprobs[0]


@pytest.mark.integration
@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 1234}])
def test_a_turn_extending_prompt_and_reply_reuses_their_kv_with_the_same_outputs(replicas, sampling):
    cached, uncached = replicas
    first = prompt(len(sampling))
    outputs = {}
    for svc in (cached, uncached):
        reply, logprobs = turn(svc, first, **sampling)
        before = counters(svc)
        second = first + reply + ENV
        outputs[svc.name] = (reply, logprobs, *turn(svc, second, **sampling), delta(svc, before))
    reply, lp1, reply2, lp2, saved = outputs["cached"]
    ref_reply, ref_lp1, ref_reply2, ref_lp2, full = outputs["uncached"]
    assert reply == ref_reply and reply2 == ref_reply2
    assert torch.allclose(torch.tensor(lp1 + lp2), torch.tensor(ref_lp1 + ref_lp2), atol=1e-4)
    # the first turn's prompt and reply but its last token (never fed) came from the cache
    reused = len(first) + len(reply) - 1
    assert saved["hits"] == 1 and saved["hit_tokens"] == reused
    assert saved["prefill"] == 1 + len(ENV)  # the reply's last token, then the environment's
    assert full["prefill"] == len(first) + len(reply) + len(ENV) and full["hit_tokens"] == 0


@pytest.mark.integration
def test_kv_is_never_reused_across_adapter_versions(replicas, tiny_model):
    cached, uncached = replicas
    name = "prefix-pol"
    adapters = {v: make_adapter(tiny_model, seed=70 + v, r=2) for v in (1, 2)}
    for svc in (cached, uncached):
        push(svc.target, adapters[1].manifest(name, 1, fingerprint(svc.target)), adapters[1].payload)
    first = prompt(99)
    reply, _ = turn(cached, first, adapter=(name, 1), temperature=0.0)
    for svc in (cached, uncached):
        push(svc.target, adapters[2].manifest(name, 2, fingerprint(svc.target)), adapters[2].payload)
    second = first + reply + ENV
    before = counters(cached)
    on_v2 = turn(cached, second, adapter=(name, 2), temperature=0.0)
    assert delta(cached, before)["hit_tokens"] == 0  # v1's KV is not v2's
    assert on_v2[0] == turn(uncached, second, adapter=(name, 2), temperature=0.0)[0]
    before = counters(cached)
    turn(cached, second, adapter=(name, 1), temperature=0.0)  # v1 itself still reuses it
    assert delta(cached, before)["hit_tokens"] == len(first) + len(reply) - 1
    before = counters(cached)
    turn(cached, second, temperature=0.0)  # and the base model is a key of its own
    assert delta(cached, before)["hit_tokens"] == 0


@pytest.mark.integration
def test_a_flood_of_distinct_long_prompts_stays_within_the_budget_then_expires(replicas, tiny_model):
    cached, _ = replicas
    config = json.loads((tiny_model / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    token_bytes = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4
    before = counters(cached)
    for i in range(20):  # 20 x 100 tokens against a budget of 600
        generate(cached.target, prompt(1000 + i, 100), n=1, max_new_tokens=1)
        now = counters(cached)
        assert now["tokens"] <= BUDGET and now["bytes"] <= BUDGET * token_bytes
        assert now["bytes"] == now["tokens"] * token_bytes
    assert delta(cached, before)["evicted_capacity"] >= 20 - BUDGET // 100
    # unused for ttl_s, every entry goes at the next lookup (a lookup is what evicts: poll with requests)
    ttl_before = counters(cached)["evicted_ttl"]

    def expired() -> bool:
        generate(cached.target, [5, 6, 7], n=1, max_new_tokens=1)
        now = counters(cached)
        return now["entries"] == 0 and now["evicted_ttl"] > ttl_before

    wait_until(expired, timeout=TTL_S + 20, what="the prefix cache's entries expire", every=0.5)
    assert counters(cached)["tokens"] == 0
