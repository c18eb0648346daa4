"""Resuming samples on a replica (GenerateRequest.resume, issue 37 item 1), in-process: the
RNG skip, the edge's refusal of hostile resume fields, and each engine's continuation (the
transformers engine against its own uninterrupted run, exactly; the served engines' follow
bookkeeping begun mid-way; the scripted engine). A proxy resuming a group whose replica was
SIGKILLed: tests/integration/proxy/test_proxy_resume.py."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import pytest_asyncio
import torch
from support.engines import collect

from rollwire.common.errors import FailedPrecondition, InvalidArgument
from rollwire.common.reasons import Reason
from rollwire.generator.config import GeneratorConfig
from rollwire.generator.convert import RequestConverter
from rollwire.generator.detokenize import TextStream, backend
from rollwire.generator.engines.embedded import transformers_engine as te
from rollwire.generator.engines.embedded.scripted import ScriptedEngine
from rollwire.generator.engines.served.follow import FollowRun, continuation_seed
from rollwire.generator.sampling import row_uniforms, sample_generator, skip_draws
from rollwire.generator.types import AdapterSelection, GroupRequest, SampleDone, SamplingParams, TokenDelta
from rollwire.v1 import generator_pb2 as pb

PARAMS = [
    SamplingParams(8),
    SamplingParams(8, temperature=0.0),
    SamplingParams(8, temperature=0.7, top_k=5),
    SamplingParams(8, temperature=1.3, top_p=0.6),
]


# -- the RNG skip ---------------------------------------------------------------------------------
@pytest.mark.parametrize("params", PARAMS)
@pytest.mark.parametrize("k", [0, 1, 7, 300])
def test_a_row_resumed_at_k_draws_the_uniforms_of_an_uninterrupted_row_from_k(params, k):
    whole = sample_generator(42, 3)
    uninterrupted = [float(row_uniforms([params], [whole])[0]) for _ in range(k + 25)]
    resumed = skip_draws(params, sample_generator(42, 3), k)
    assert [float(row_uniforms([params], [resumed])[0]) for _ in range(25)] == uninterrupted[k:]
    if params.temperature == 0:  # greedy draws nothing: the generator is untouched
        assert resumed.getstate() == sample_generator(42, 3).getstate()


def test_mixed_rows_of_one_step_each_skip_only_their_own_draws():
    """The step draws once per sampling row and never for a greedy one, whatever else is batched."""
    steps = 9
    gens = [sample_generator(5, i) for i in range(len(PARAMS))]
    for _ in range(steps):
        row_uniforms(PARAMS, gens)
    skipped = [skip_draws(p, sample_generator(5, i), steps) for i, p in enumerate(PARAMS)]
    assert [g.getstate() for g in gens] == [g.getstate() for g in skipped]


# -- the edge: hostile resume fields --------------------------------------------------------------
VOCAB, CONTEXT, N, MAX_NEW = 1000, 4096, 4, 16


@pytest_asyncio.fixture
async def convert(tmp_path) -> RequestConverter:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": VOCAB, "max_position_embeddings": CONTEXT}))
    engine = ScriptedEngine(tmp_path)
    await engine.start()
    return RequestConverter(GeneratorConfig(model=str(tmp_path), engine="scripted"), engine)


def resuming(entries: list[tuple[int, list[int]]], **kw) -> pb.GenerateRequest:
    req = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[1, 2, 3]), n=N, sampling=pb.SamplingParams(max_new_tokens=MAX_NEW)
    )
    for index, ids in entries:
        req.resume.add(sample_index=index, token_ids=ids)
    for key, value in kw.items():
        getattr(req, key).CopyFrom(value)
    return req


def hostile(rng: random.Random) -> tuple[list[tuple[int, list[int]]], str]:
    """One malformed resume list and what is wrong with it."""
    ok = [(i, [rng.randrange(VOCAB) for _ in range(rng.randrange(MAX_NEW))]) for i in rng.sample(range(N), 2)]
    kind = rng.choice(["index", "twice", "too_many", "too_long", "negative", "over_vocab", "huge_id"])
    if kind == "index":
        return [*ok, (rng.choice([N, N + 1, 2**31, 2**32 - 1]), [])], kind
    if kind == "twice":
        return [*ok, (ok[0][0], [1])], kind
    if kind == "too_many":
        return [(i % N, []) for i in range(N + 1 + rng.randrange(50))], kind
    if kind == "too_long":
        return [*ok[:1], (ok[1][0], [5] * (MAX_NEW + rng.randrange(3)))], kind
    bad = {"negative": -rng.randrange(1, 2**31), "over_vocab": VOCAB + rng.randrange(5), "huge_id": 2**31 - 1}[kind]
    ids = ok[1][1][: MAX_NEW - 2]
    ids.insert(rng.randrange(len(ids) + 1), bad)
    return [ok[0], (ok[1][0], ids)], kind


async def test_generated_hostile_resume_fields_are_refused_before_any_work(convert):
    rng = random.Random(37)
    seen = set()
    for _ in range(300):
        entries, kind = hostile(rng)
        seen.add(kind)
        with pytest.raises(InvalidArgument) as refused:
            await convert.group(resuming(entries), "r")
        assert refused.value.reason == Reason.BAD_RESUME, (kind, entries)
        assert "resume" in refused.value.message and len(refused.value.message) < 400
    assert len(seen) == 7
    with pytest.raises(InvalidArgument) as refused:  # a session turn is continued by its proxy, never resumed
        await convert.group(resuming([(0, [1])], session=pb.SessionTurn(id="s")), "r")
    assert refused.value.reason == Reason.BAD_RESUME


async def test_a_valid_resume_becomes_the_samples_the_group_runs(convert):
    rng = random.Random(3)
    for _ in range(50):
        chosen = rng.sample(range(N), rng.randrange(1, N + 1))
        entries = [(i, [rng.randrange(VOCAB) for _ in range(rng.randrange(MAX_NEW))]) for i in chosen]
        group = await convert.group(resuming(entries), "r")
        assert group.resume == dict(entries) and group.rows == len(chosen) and group.indices() == sorted(chosen)
    plain = await convert.group(resuming([]), "r")
    assert plain.resume == {} and plain.rows == N and plain.indices() == list(range(N))


async def test_an_engine_that_cannot_continue_samples_refuses_resume(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": VOCAB}))
    engine = ScriptedEngine(tmp_path)
    await engine.start()
    engine.resumes_samples = False  # an engine without the capability, as a third-party one would be
    with pytest.raises(FailedPrecondition) as refused:
        await RequestConverter(GeneratorConfig(model=str(tmp_path), engine="scripted"), engine).group(
            resuming([(1, [4, 5])]), "r"
        )
    assert refused.value.reason == Reason.RESUME_UNSUPPORTED and "scripted" in refused.value.message


# -- the transformers engine: exact ---------------------------------------------------------------
@pytest_asyncio.fixture(scope="module")
async def engine(tiny_model):
    eng = te.TransformersEngine(tiny_model, max_batch_rows=64, threads=1)
    await eng.start()
    yield eng
    await eng.close()


def group(engine, n: int, resume: dict | None = None, **sampling) -> GroupRequest:
    sampling.setdefault("max_new_tokens", 24)
    return GroupRequest(
        "resume", engine.tokenize("resume me: "), n, SamplingParams(**sampling), AdapterSelection(), resume=resume or {}
    )


@pytest.mark.parametrize(
    "sampling",
    [
        dict(seed=77, temperature=0.9, top_k=20, ignore_eos=True),
        dict(seed=78, temperature=0.0, ignore_eos=True),
        dict(seed=79, temperature=1.3, top_p=0.8, ignore_eos=True),
        dict(sample_seeds=(5, 1 << 62, 9, 11), temperature=1.1, ignore_eos=True),
    ],
)
async def test_a_resumed_sample_goes_on_exactly_as_its_uninterrupted_run(engine, sampling):
    full = await collect(engine, group(engine, 4, **sampling))
    cut = {0: 5, 1: 0, 3: 23}  # sample 2 finished before the failure: not listed, never run
    resume = {i: full["tokens"][i][:k] for i, k in cut.items()}
    out = await collect(engine, group(engine, 4, resume, **sampling))
    assert sorted(out["done"]) == sorted(cut) and set(out["tokens"]) <= set(cut)
    for i, k in cut.items():
        assert out["tokens"][i] == full["tokens"][i][k:], i
        assert torch.allclose(torch.tensor(out["logprobs"][i]), torch.tensor(full["logprobs"][i][k:]), atol=1e-5)
        assert full["text"][i] == engine.tokenizer.decode(full["tokens"][i][:k], skip_special_tokens=True) + out[
            "text"
        ].get(i, "")
        done, whole = out["done"][i], full["done"][i]
        assert (done.reason, done.prompt_tokens, done.completion_tokens) == (
            whole.reason,
            whole.prompt_tokens,
            whole.completion_tokens,
        )


async def test_a_stop_string_that_spans_the_seam_ends_the_sample_where_it_would_have(engine):
    free = await collect(engine, group(engine, 1, seed=5, temperature=1.0, max_new_tokens=40, ignore_eos=True))
    text = engine.tokenizer.decode(free["tokens"][0], skip_special_tokens=True)
    stop = text[20:23]  # three characters: one token each in the tiny model's vocabulary
    stopping: dict[str, Any] = dict(seed=5, temperature=1.0, max_new_tokens=40, ignore_eos=True, stop=(stop,))
    whole = await collect(engine, group(engine, 1, None, **stopping))
    tokens = whole["tokens"][0]
    assert whole["done"][0].reason == "stop" and whole["text"][0].endswith(stop)
    have = tokens[:-2]  # the seam falls inside the stop string: two of its characters come after it
    out = await collect(engine, group(engine, 1, {0: have}, **stopping))
    assert out["tokens"][0] == tokens[-2:] and out["done"][0].reason == "stop"
    assert out["done"][0].completion_tokens == len(tokens)


def test_a_primed_text_stream_continues_the_deltas_of_an_unsplit_one(tiny_model):
    from transformers import AutoTokenizer

    tok = backend(AutoTokenizer.from_pretrained(tiny_model))
    rng = random.Random(8)
    for _ in range(20):
        ids = [rng.randrange(tok.get_vocab_size()) for _ in range(30)]
        k = rng.randrange(1, 29)
        whole = TextStream(tok, keep=8)
        deltas = [whole.add(t) for t in ids]
        primed = TextStream(tok, keep=8)
        primed.add(ids[:k])
        assert [primed.add(t) for t in ids[k:]] == deltas[k:]
        assert primed.tail == whole.tail


# -- the served engines (follow.py begun mid-way) and the scripted engine -------------------------
def test_a_served_engine_continues_only_the_resumed_samples_under_the_groups_version(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    prompt = [5, 17, 33]
    g = GroupRequest(
        "g",
        prompt,
        3,
        SamplingParams(10, seed=9, temperature=0.7),
        AdapterSelection("a", 4, "h4"),
        resume={0: [7, 8], 2: []},
    )
    run = FollowRun(g, lambda: TextStream(backend(tok)), frozenset({tok.eos_token_id}))
    segments = run.segments()
    assert [k for k, _ in segments] == [(0,), (2,)]  # sample 1 finished elsewhere: not run
    (_, zero), (_, two) = segments
    assert zero.prompt_ids == [*prompt, 7, 8] and zero.sampling.max_new_tokens == 8 and zero.adapter.version == 4
    assert zero.sampling.seed == continuation_seed(9, 0, 2) and two.prompt_ids == prompt
    out = run.take((0,), [TokenDelta(0, [9], [-0.5], "", 4), SampleDone(0, "length", 5, 1)])
    assert isinstance(out[0], TokenDelta) and out[0].token_ids == [9] and out[0].text == tok.decode([9])
    assert out[1] == SampleDone(0, "length", len(prompt), 3)  # all its tokens, the prompt without them
    assert not run.complete
    run.take((2,), [SampleDone(0, "eos", 3, 0)])
    assert run.complete


async def test_the_scripted_engine_resumes_a_sample_at_its_position(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 500}))
    engine = ScriptedEngine(tmp_path, tokens_per_s=0)
    await engine.start()
    sampling = SamplingParams(max_new_tokens=12, seed=4)
    full = await collect(engine, GroupRequest("s", [1, 2], 3, sampling))
    out = await collect(engine, GroupRequest("s", [1, 2], 3, sampling, resume={2: full["tokens"][2][:5], 0: []}))
    assert out["tokens"] == {0: full["tokens"][0], 2: full["tokens"][2][5:]} and sorted(out["done"]) == [0, 2]
    assert out["done"][2].completion_tokens == 12
