"""One replica generating for three adapters and the base model at once (issue 35, item 3):
rows of every adapter share the forward passes (the replica's batch_rows histogram shows a
pass that held every group's rows), and each row's tokens and logprobs are those of its
adapter's run alone (same seed: tokens identical, logprobs within 1e-5), of a separate PEFT
model per adapter (teacher-forced), and of the replica's own Score. The groups share one
prompt, so a prefix cache keyed on anything less than the adapter version would serve one
adapter's keys and values to another; resumed samples (GenerateRequest.resume) go through
the same mixed batch and continue exactly. Score and PEFT are teacher-forced (one pass over
prompt + tokens), generation decodes token by token: they agree within float rounding.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from support.engines import forward_logprobs
from support.wire import Adapter, Group, fingerprint, make_adapter, metric_value, peft_reference, push, stub

from rollwire.client import Client
from rollwire.v1 import generator_pb2 as pb

pytestmark = pytest.mark.integration
PROMPT = "one prompt for every adapter: 12+34="
N, TOKENS, SPLIT = 5, 40, 15
# 4 groups x N rows = 20 rows; any 3 of them hold 15 <= 16, so a pass in (16, 32] held all four
ALL_FOUR = (16, 32)
MLP = ("gate_proj", "up_proj", "down_proj")
SCALE = 0.15
"""The adapters' random weights: their deltas are about the size of the base layers' outputs (a
trained LoRA's are smaller). Every difference below is float rounding, which grows with the
deltas: with 0.5 (deltas ~10x the base outputs) mixed rows differed from their runs alone by
up to 1.3e-5, and by 6.7e-6 before the batched apply (issue 35); at this scale by ~1e-6."""


@pytest.fixture(scope="module")
def adapters(generator, tiny_model) -> dict[str, Adapter]:
    """Three adapters of different ranks, alphas and target modules, pushed to one replica."""
    made = {
        "ma-a": make_adapter(tiny_model, seed=61, r=4, lora_alpha=8, scale=SCALE),
        "ma-b": make_adapter(
            tiny_model, seed=62, r=16, lora_alpha=8, targets=("q_proj", "v_proj", "o_proj"), scale=SCALE
        ),
        "ma-c": make_adapter(tiny_model, seed=63, r=8, lora_alpha=24, targets=MLP, scale=SCALE),
    }
    fp = fingerprint(generator.target)
    for name, adapter in made.items():
        push(generator.target, adapter.manifest(name, 1, fp), adapter.payload)
    return made


def request(adapter: str | None, seed: int, resume: dict[int, list[int]] | None = None) -> pb.GenerateRequest:
    req = pb.GenerateRequest(
        text=PROMPT,
        n=N,
        sampling=pb.SamplingParams(max_new_tokens=TOKENS, ignore_eos=True, temperature=1.0, seed=seed),
    )
    if adapter:
        req.adapter.name, req.adapter.version = adapter, 1
    for i, tokens in (resume or {}).items():
        req.resume.add(sample_index=i, token_ids=tokens)
    return req


def run(target: str, req: pb.GenerateRequest) -> Group:
    g = Group(None, {}, {}, {}, {}, {})  # type: ignore[arg-type]
    for msg in stub(target).Generate(req, timeout=120):
        if msg.HasField("started"):
            g.started = msg.started
        for t in msg.tokens:
            g.tokens.setdefault(t.sample_index, []).extend(t.token_ids)
            g.logprobs.setdefault(t.sample_index, []).extend(t.logprobs)
        for f in msg.finished:
            g.finished[f.sample_index] = f
    assert sorted(g.finished) == list(range(N))
    return g


def passes_with_all_four(generator) -> float:
    text = generator.metrics()
    low, high = ALL_FOUR
    at = [metric_value(text, "rollwire_generator_batch_rows_bucket", f'le="{float(b)}"') for b in (low, high)]
    return at[1] - at[0]


def together(generator, requests: list[pb.GenerateRequest]) -> list[Group]:
    """Run the requests at once; the replica batches them (checked: a pass held all four)."""
    before = passes_with_all_four(generator)
    with ThreadPoolExecutor(len(requests)) as pool:
        groups = list(pool.map(lambda r: run(generator.target, r), requests))
    assert passes_with_all_four(generator) > before, "the groups never shared a forward pass"
    return groups


def assert_same(mixed: Group, alone: Group, samples, name=None) -> None:
    for i in samples:
        assert mixed.tokens[i] == alone.tokens[i], (name, i)
        diff = (torch.tensor(mixed.logprobs[i]) - torch.tensor(alone.logprobs[i])).abs().max()
        assert diff <= 1e-5, (name, i, float(diff))


def test_mixed_rows_equal_each_adapters_own_run_peft_and_score(generator, tiny_model, adapters):
    names: list[str | None] = [*adapters, None]
    requests = [request(name, seed=70 + k) for k, name in enumerate(names)]
    alone = [run(generator.target, r) for r in requests]
    mixed = together(generator, requests)
    for name, one, both in zip(names, alone, mixed, strict=True):
        assert_same(both, one, range(N), name)
        model = peft_reference(tiny_model, adapters[name]) if name else None
        prompt = list(both.started.prompt_token_ids)
        with Client(generator.target, timeout=60) as client:
            scored = client.score([(prompt, both.tokens[i]) for i in range(N)], adapter=f"{name}@1" if name else None)
        for i in range(N):
            got = torch.tensor(both.logprobs[i])
            assert (got - torch.tensor(scored.logprobs[i])).abs().max() <= 1e-5, (name, i)
            if model is not None:  # an independent computation: the adapter's own PEFT model
                assert (got - forward_logprobs(model, prompt, both.tokens[i])).abs().max() <= 1e-5, (name, i)
    distinct = {tuple(g.tokens[0]) for g in mixed}
    assert len(distinct) == len(names)  # the adapters really change what is sampled


def test_resumed_samples_of_every_adapter_continue_exactly_in_one_batch(generator, adapters):
    """Every group resumes each sample from its first SPLIT + i tokens, all groups at once
    (their prompts come from the prefix cache, keyed per adapter version): the continuations
    are the uninterrupted runs' remaining tokens."""
    names: list[str | None] = [*adapters, None]
    whole = [run(generator.target, request(name, seed=90 + k)) for k, name in enumerate(names)]
    cut = {i: SPLIT + i for i in range(N)}
    requests = [
        request(name, 90 + k, {i: g.tokens[i][: cut[i]] for i in range(N)})
        for k, (name, g) in enumerate(zip(names, whole, strict=True))
    ]
    resumed = together(generator, requests)
    for one, cont in zip(whole, resumed, strict=True):
        for i in range(N):
            at = cut[i]
            assert one.tokens[i][:at] + cont.tokens[i] == one.tokens[i]
            diff = (torch.tensor(cont.logprobs[i]) - torch.tensor(one.logprobs[i][at:])).abs().max()
            assert diff <= 1e-5, (i, float(diff))
