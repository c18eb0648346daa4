"""The embedded engine's batched step (issue 13): sampling every row in one call, LoRA of
every adapter in one batched apply (more in test_lora_mixed.py), incremental detokenizing,
one hand-off per step, and that none of it changes a sample's tokens, logprobs or text.

Pure parts (the per-row sampling transform, the inverse-CDF draw, TextStream, the mailbox)
are checked against independent computations; the engine in-process against a teacher-forced
forward pass of the tiny model and of a local PEFT model.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time

import pytest
import pytest_asyncio
import torch
from support.engines import collect, forward_logprobs, manifest_for
from support.wire import make_adapter, peft_reference

from rollwire.common.errors import InvalidArgument
from rollwire.common.lora import LoraShape
from rollwire.generator.detokenize import TextStream, backend
from rollwire.generator.engines.embedded import transformers_engine as te
from rollwire.generator.engines.embedded.lora import LoraSet
from rollwire.generator.sampling import (
    inverse_cdf,
    nonfinite_rows,
    row_uniforms,
    sample_generator,
    sampling_logprobs,
)
from rollwire.generator.types import AdapterSelection, GroupRequest, SamplingParams, TokenDelta

MIXED = [
    SamplingParams(4),
    SamplingParams(4, temperature=0.7, top_k=5),
    SamplingParams(4, temperature=0.0),
    SamplingParams(4, temperature=1.3, top_p=0.6),
    SamplingParams(4, temperature=0.5, top_k=20, top_p=0.9),
    SamplingParams(4, top_k=1),
]


# -- the sampling transform and the draw ------------------------------------------------------------
def test_per_row_params_give_each_row_exactly_its_own_transform():
    logits = torch.randn(len(MIXED), 50, generator=torch.Generator().manual_seed(3)) * 3
    together = sampling_logprobs(logits, MIXED)
    for i, params in enumerate(MIXED):
        alone = sampling_logprobs(logits[i : i + 1], params)
        assert torch.equal(together[i : i + 1], alone), params  # bit for bit: rows never mix


def test_inverse_cdf_follows_the_distribution_and_never_draws_a_masked_token():
    probs = torch.tensor([0.5, 0.0, 0.3, 0.0, 0.2])
    logprobs = probs.log().expand(40_000, -1)
    params = SamplingParams(1)
    rng = random.Random(11)
    tokens = inverse_cdf(logprobs, params, torch.tensor([rng.random() for _ in range(40_000)], dtype=torch.float64))
    counts = torch.bincount(tokens, minlength=5).double() / 40_000
    assert counts[1] == 0 and counts[3] == 0
    assert torch.allclose(counts, probs.double(), atol=0.01), counts
    inside = torch.tensor([0.0, 0.25, 0.49, 0.51, 0.79, 0.81, 1 - 2**-53], dtype=torch.float64)
    assert inverse_cdf(probs.log().expand(7, -1), params, inside).tolist() == [0, 0, 0, 2, 2, 4, 4]
    tail_masked = torch.tensor([0.2, 0.8, 0.0, 0.0]).log().expand(2, -1)  # the top of the CDF is flat
    assert inverse_cdf(tail_masked, params, torch.tensor([1 - 2**-53, 0.999999], dtype=torch.float64)).tolist() == [
        1,
        1,
    ]


def test_greedy_rows_take_the_argmax_and_draw_nothing():
    logits = torch.tensor([[0.0, 3.0, 1.0], [0.0, 3.0, 1.0]])
    params = [SamplingParams(1, temperature=0.0), SamplingParams(1)]
    gens = [sample_generator(5, 0), sample_generator(5, 1)]
    uniforms = row_uniforms(params, gens)
    assert uniforms[0] == 0.0 and uniforms[1] == sample_generator(5, 1).random()
    assert gens[0].random() == sample_generator(5, 0).random()  # the greedy row's stream did not move
    lp = sampling_logprobs(logits, params)
    assert int(inverse_cdf(lp, params, uniforms)[0]) == 1


def test_nonfinite_rows_names_only_the_broken_rows():
    lp = torch.log_softmax(torch.zeros(4, 6), -1)
    lp[1, 2] = math.nan
    lp[3, 0] = math.inf
    lp[0, 1] = -math.inf  # masked, fine
    assert nonfinite_rows(lp).tolist() == [False, True, False, True]


# -- incremental detokenizing ------------------------------------------------------------------------
def _byte_level_tokenizer():
    """A byte-level BPE trained here, so multi-byte characters are split across tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<eos>"]
    )
    tok.train_from_iterator(["héllo wörld 日本語 🙂 naïve café"] * 10, trainer)
    return tok


def test_text_stream_releases_whole_characters_and_matches_a_full_decode():
    tok = _byte_level_tokenizer()
    eos = tok.token_to_id("<eos>")
    ids = [*tok.encode("naïve 日本 🙂 ok é").ids, eos, *tok.encode(" 語").ids, 10_000]
    stream = TextStream(tok, keep=3)
    deltas = [stream.add(i) for i in ids]
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == "naïve 日本 🙂 ok é 語"
    assert all("\ufffd" not in d for d in deltas)
    assert any(d == "" for d in deltas[:-2])  # some token ended inside a character and waited
    assert deltas[-1] == ""  # an id the tokenizer does not know adds nothing
    assert stream.tail.endswith("é 語")  # at least the last `keep` characters
    chunked = TextStream(tok)
    assert "".join(chunked.add(ids[i : i + 3]) for i in range(0, len(ids), 3)) == "".join(deltas)


def test_text_stream_recovers_when_the_window_cannot_extend_its_text():
    """A decoder whose window no longer extends what it decoded before (here: once, at the third
    token) costs one decode of the whole sample; the text is still the decode, never taken back."""
    tok = _byte_level_tokenizer()
    ids = tok.encode("héllo wörld café").ids
    calls = {"n": 0}

    class Rewriting:
        def decode(self, some, skip_special_tokens=True):
            calls["n"] += 1
            text = tok.decode(some, skip_special_tokens=skip_special_tokens)
            return "?" + text if calls["n"] == 4 and some != ids[: len(some)] else text

    stream = TextStream(Rewriting())  # pyright: ignore[reportArgumentType]  # duck-typed: decode only
    out = "".join(stream.add(i) for i in ids) + stream.finish()
    assert out == "héllo wörld café"


def test_the_tiny_models_char_tokenizer(tiny_model):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_model)
    ids = [*hf("12 + 34 = 46", add_special_tokens=False).input_ids, hf.eos_token_id]
    stream = TextStream(backend(hf))
    deltas = [stream.add(i) for i in ids]
    assert deltas[:-1] == list("12 + 34 = 46") and deltas[-1] == ""


# -- LoRA by forward hooks ------------------------------------------------------------------------------
def test_lora_rows_match_their_own_peft_model_and_base_rows_the_base_model(tiny_model):
    from transformers import AutoModelForCausalLM

    a, b = make_adapter(tiny_model, seed=21, r=4), make_adapter(tiny_model, seed=22, r=8)
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    lora = LoraSet(model)
    lora.load("a", a.shape, a.state_dict)
    lora.load("b", b.shape, b.state_dict)
    ids = torch.randint(3, 60, (4, 9), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        with lora.routed(["a", None, "b", "a"]):
            mixed = model(input_ids=ids).logits
        base = model(input_ids=ids).logits  # no routing: the base model, untouched by the loads
        ref_a = peft_reference(tiny_model, a)(input_ids=ids).logits
        ref_b = peft_reference(tiny_model, b)(input_ids=ids).logits
    assert torch.allclose(mixed[[0, 3]], ref_a[[0, 3]], atol=1e-4)
    assert torch.allclose(mixed[2], ref_b[2], atol=1e-4)
    assert torch.equal(mixed[1], base[1])
    assert not torch.allclose(ref_a, base, atol=1e-2)  # the adapters really change the logits


def test_lora_loads_whole_or_not_at_all(tiny_model):
    from transformers import AutoModelForCausalLM

    a = make_adapter(tiny_model, seed=23, r=4)
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    lora = LoraSet(model)
    broken = dict(a.state_dict)
    last = sorted(k for k in broken if k.endswith("lora_B.weight"))[-1]
    broken[last] = torch.zeros(broken[last].shape[0] + 1, broken[last].shape[1])
    with pytest.raises(InvalidArgument, match="must be"):
        lora.load("x", a.shape, broken)
    unpaired = {k: v for k, v in a.state_dict.items() if k != last}
    with pytest.raises(InvalidArgument, match="pairs"):
        lora.load("x", a.shape, unpaired)
    with pytest.raises(InvalidArgument, match="does not have"):
        lora.load(
            "x",
            a.shape,
            {
                "base_model.model.nope.lora_A.weight": torch.zeros(4, 4),
                "base_model.model.nope.lora_B.weight": torch.zeros(4, 4),
            },
        )
    assert "x" not in lora and len(lora) == 0
    ids = torch.randint(3, 60, (2, 5))
    with torch.inference_mode():
        before = model(input_ids=ids).logits
        with lora.routed(["x", "x"]):
            assert torch.equal(model(input_ids=ids).logits, before)
    lora.load("x", LoraShape(a.r, a.lora_alpha, a.targets), a.state_dict)
    lora.unload("x")
    with torch.inference_mode(), lora.routed(["x", "x"]):
        assert torch.equal(model(input_ids=ids).logits, before)


# -- the engine in-process ------------------------------------------------------------------------------
@pytest_asyncio.fixture(scope="module")
async def engine(tiny_model):
    eng = te.TransformersEngine(tiny_model, max_batch_rows=64, threads=1)
    await eng.start()
    yield eng
    await eng.close()


def group(engine, text: str, n: int, adapter: AdapterSelection | None = None, **sampling) -> GroupRequest:
    sampling.setdefault("max_new_tokens", 10)
    sampling.setdefault("ignore_eos", True)
    return GroupRequest(
        f"batching-{text}", engine.tokenize(text), n, SamplingParams(**sampling), adapter or AdapterSelection()
    )


async def together(engine, groups: list[GroupRequest]) -> list[dict]:
    """Admit every group in one prefill, so they share every forward pass and sampling call."""
    with engine._cv:
        tasks = [asyncio.create_task(collect(engine, g)) for g in groups]
        for _ in range(len(groups) + 2):
            await asyncio.sleep(0)
        assert len(engine._pending) == len(groups)
    return await asyncio.wait_for(asyncio.gather(*tasks), 120)


async def test_a_seeded_sample_is_the_same_alone_and_in_a_mixed_batch(engine, tiny_model):
    """Other groups with other params and adapters in the batch change nothing about a group."""
    a = make_adapter(tiny_model, seed=31, r=4)
    await engine.load_adapter("bt-a", manifest_for(a, "bt", 1), a.payload)
    try:
        sel = AdapterSelection("bt", 1, "bt-a")
        groups = [
            group(engine, "alpha", 3, seed=101, temperature=0.8, top_k=12),
            group(engine, "beta beta", 2, sel, seed=102),
            group(engine, "g", 2, seed=103, temperature=0.0),
            group(engine, "delta", 4, sel, seed=104, top_p=0.7, stop=("zz",)),
        ]
        alone = [await collect(engine, g) for g in groups]
        mixed = await together(engine, groups)
        for one, both in zip(alone, mixed, strict=True):
            assert both["tokens"] == one["tokens"]
            assert both["text"] == one["text"]
            for i, lps in one["logprobs"].items():
                assert torch.allclose(torch.tensor(both["logprobs"][i]), torch.tensor(lps), atol=1e-5)
        # and the numbers are the teacher-forced ones: base and adapter rows, tempered and truncated
        base, peft = engine.model, peft_reference(tiny_model, a)
        checks = [(groups[0], mixed[0], base, dict(temperature=0.8, top_k=12)), (groups[1], mixed[1], peft, {})]
        checks.append((groups[3], mixed[3], peft, dict(top_p=0.7)))
        for g, out, model, transform in checks:
            for i, tokens in out["tokens"].items():
                expected = forward_logprobs(model, g.prompt_ids, tokens, **transform)
                assert torch.allclose(torch.tensor(out["logprobs"][i]), expected, atol=1e-4), (g.request_id, i)
    finally:
        await engine.unload_adapter("bt-a")


async def test_per_sample_seeds_draw_each_sample_as_its_own_request_would(engine):
    """A proxy's merged single-sample requests (sampling.sample_seeds): sample i of the merged
    group equals sample 0 of a group seeded sample_seeds[i], tokens exactly and logprobs to a
    few ulps (other rows in the batch), while the prompt is prefilled once."""
    seeds = (7, 1 << 62, 12345678901, 0)
    merged = await collect(engine, group(engine, "merge me", len(seeds), sample_seeds=seeds, temperature=1.2))
    for i, seed in enumerate(seeds):
        alone = await collect(engine, group(engine, "merge me", 1, seed=seed, temperature=1.2))
        assert merged["tokens"][i] == alone["tokens"][0], seed
        assert torch.allclose(torch.tensor(merged["logprobs"][i]), torch.tensor(alone["logprobs"][0]), atol=1e-5)
    assert len({tuple(t) for t in merged["tokens"].values()}) > 1  # the seeds really differ


async def test_text_is_the_decode_of_the_tokens(engine):
    out = await collect(engine, group(engine, "text", 4, seed=7, max_new_tokens=24, ignore_eos=False))
    for i, tokens in out["tokens"].items():
        assert out["text"].get(i, "") == engine.tokenizer.decode(tokens, skip_special_tokens=True)


_NOTHING = contextlib.nullcontext()


def _tokens(messages) -> int:
    return sum(len(ev.token_ids) for events in messages for ev in events if isinstance(ev, TokenDelta))


async def test_events_reach_a_busy_loop_in_order_with_few_wake_ups(engine, monkeypatch):
    """While the event loop is blocked the worker keeps stepping; the loop then finds every
    step's events queued in order, delivered by far fewer callbacks than steps."""
    drains = []
    real = te._Mailbox._drain
    monkeypatch.setattr(te._Mailbox, "_drain", lambda self: (drains.append(1), real(self)))
    stream = engine.generate(group(engine, "busy", 2, seed=9, max_new_tokens=30))
    received = [await anext(stream)]  # the group is running
    loop, deadline = asyncio.get_running_loop(), time.monotonic() + 60
    while time.monotonic() < deadline:  # block the loop on purpose (the condition under test) until
        box = engine._mailboxes.get(loop)  # the worker has posted every token, however slow it runs
        with box._lock if box is not None else _NOTHING:
            posted = [ev for _, events in (box._items if box is not None else []) for ev in events]
        if _tokens(received) + _tokens([posted]) >= 60:
            break
        time.sleep(0.01)
    received += [events async for events in stream]
    tokens: dict[int, list[int]] = {0: [], 1: []}
    for events in received:
        for ev in events:
            if isinstance(ev, TokenDelta):
                tokens[ev.sample_index].extend(ev.token_ids)
    assert [len(t) for t in tokens.values()] == [30, 30]
    assert len(drains) < 10 and len(received) < 10, (len(drains), len(received))  # one per step would be 30
