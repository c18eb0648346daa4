"""Following on engine servers, by continuation (engines/served/follow.py): the bookkeeping on the
tiny model's tokenizer. A replica over the SGLang double with a push landing mid-generation:
tests/integration/generator/test_served_follow_sglang.py."""

from __future__ import annotations

import pytest

from rollwire.generator.detokenize import TextStream, backend
from rollwire.generator.engines.served.follow import FollowRun, continuation_seed
from rollwire.generator.sampling import sample_seed
from rollwire.generator.types import AdapterSelection, GroupRequest, SampleDone, SamplingParams, TokenDelta

PROMPT = [5, 17, 33, 40, 12]


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def run_for(tokenizer, n=2, **sampling) -> FollowRun:
    sampling.setdefault("max_new_tokens", 10)
    group = GroupRequest("g", list(PROMPT), n, SamplingParams(**sampling), AdapterSelection("a", 1, "h1"), True)
    return FollowRun(group, lambda: TextStream(backend(tokenizer)), frozenset({tokenizer.eos_token_id}))


def delta(index, ids, version=1) -> TokenDelta:
    return TokenDelta(index, list(ids), [-0.5] * len(ids), "", version)


def test_a_switch_continues_each_unfinished_sample_from_its_own_tokens(tokenizer):
    run = run_for(tokenizer, n=3, seed=9, max_new_tokens=6, temperature=0.7)
    ((key, first),) = run.segments()
    assert key == (0, 1, 2) and first.n == 3 and first.adapter.version == 1
    run.take(key, [delta(0, [7, 8]), delta(1, [9]), delta(2, [3, 4])])
    run.take(key, [SampleDone(2, "eos", 5, 2)])
    assert not run.switched()
    run.group.adapter = AdapterSelection("a", 2, "h2")  # what the servicer does on commit
    assert run.switched()
    assert run.switch() == []
    continued = run.segments()
    assert [k for k, _ in continued] == [(0,), (1,)]
    (_, zero), (_, one) = continued
    assert zero.prompt_ids == [*PROMPT, 7, 8] and zero.n == 1 and zero.adapter.version == 2
    assert zero.sampling.max_new_tokens == 4 and one.sampling.max_new_tokens == 5
    assert zero.sampling.seed == continuation_seed(9, 0, 2) == sample_seed(sample_seed(9, 0), 3)
    assert zero.sampling.temperature == 0.7 and one.prompt_ids == [*PROMPT, 9]
    out = run.take((1,), [delta(0, [10, 11], version=2), SampleDone(0, "length", 6, 2)])
    assert isinstance(out[0], TokenDelta) and out[0].sample_index == 1 and out[0].version == 2
    assert out[1] == SampleDone(1, "length", len(PROMPT), 3)


def test_samples_already_complete_at_the_switch_end_without_a_request(tokenizer):
    eos = tokenizer.eos_token_id
    run = run_for(tokenizer, n=3, max_new_tokens=3)
    key = run.segments()[0][0]
    run.take(key, [delta(0, [7, 8, 9]), delta(1, [7, eos]), delta(2, [7])])
    run.group.adapter = AdapterSelection("a", 2, "h2")
    ended = run.switch()
    assert ended == [SampleDone(0, "length", len(PROMPT), 3), SampleDone(1, "eos", len(PROMPT), 2)]
    assert [k for k, _ in run.segments()] == [(2,)]


def test_a_stop_string_across_the_seam_ends_the_sample_at_the_token_completing_it(tokenizer):
    ids = tokenizer("xy ab cd", add_special_tokens=False).input_ids
    text = [tokenizer.decode(ids[: k + 1]) for k in range(len(ids))]
    cut = next(k for k in range(len(ids)) if "a" in text[k] and "ab" not in text[k])  # "a" spelled, "b" not yet
    done_at = next(k for k in range(len(ids)) if "ab" in text[k])
    assert done_at > cut, "the tokenizer must split between a and b for this test"
    run = run_for(tokenizer, n=1, stop=("ab",), max_new_tokens=20)
    run.take((0,), [delta(0, ids[: cut + 1])])
    run.group.adapter = AdapterSelection("a", 2, "h2")
    assert run.switch() == []
    out = run.take((0,), [delta(0, ids[cut + 1 :], version=2)])
    kept = [t for e in out if isinstance(e, TokenDelta) for t in e.token_ids]
    assert kept == ids[cut + 1 : done_at + 1]
    assert out[-1] == SampleDone(0, "stop", len(PROMPT), done_at + 1) and run.complete
    assert run.take((0,), [delta(0, [1], version=2)]) == []  # whatever the server sent after is dropped
