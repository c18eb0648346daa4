"""Following on engine servers, by continuation (served_follow.py): the bookkeeping on the
tiny model's tokenizer, and a replica over the SGLang protocol double (tests/support/
sglang_double.py) with a push landing while the double holds the group mid-generation.

Independent computation: a PEFT model per version, teacher-forced over prompt + every token
before (the KV a continuation really has: it prefilled it under its own version).
"""

from __future__ import annotations

import pytest
from support.engines import forward_logprobs
from support.follow import follow_with_push
from support.processes import start_generator
from support.sglang_double import DoubleModel, DoubleServer, Options
from support.wire import fingerprint, make_adapter, peft_reference, push

from rollwire.generator.detokenize import TextStream, backend
from rollwire.generator.engines.served_follow import FollowRun, continuation_seed
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


# -- a replica over the SGLang double --------------------------------------------------------------
@pytest.fixture
def double(tiny_model):
    options = Options(
        model_path=str(tiny_model),
        enable_lora=True,
        max_lora_rank=16,
        lora_target_modules=["all"],
        max_loaded_loras=3,
        enable_deterministic_inference=True,
    )
    server = DoubleServer(options, DoubleModel(str(tiny_model))).start()
    yield server
    server.release.set()
    server.stop()


@pytest.mark.integration
def test_a_following_group_continues_on_sglang_under_the_new_version(double, tiny_model, tmp_path):
    svc = start_generator(
        tiny_model,
        tmp_path,
        "sg-follow",
        "--engine",
        "sglang",
        "--set",
        f"sglang.url={double.url}",
        "--set",
        f"sglang.adapter_dir={tmp_path / 'adapters'}",
    )
    try:
        fp = fingerprint(svc.target)
        adapters = {v: make_adapter(tiny_model, seed=70 + v, r=4) for v in (1, 2)}
        push(svc.target, adapters[1].manifest("fol", 1, fp), adapters[1].payload)
        double.hold_at_tokens = 6  # the group waits there until v2 is committed

        def push_v2() -> None:
            push(svc.target, adapters[2].manifest("fol", 2, fp), adapters[2].payload)
            double.release.set()

        got = follow_with_push(
            svc.target, PROMPT, 2, push_v2, max_new_tokens=24, ignore_eos=True, seed=3, adapter="fol@latest"
        )
    finally:
        svc.stop()
    loads = [c.body["lora_name"] for c in double.calls if c.path == "/load_lora_adapter"]
    calls = double.generate_calls()
    first, continued = calls[0], calls[1:]
    assert first["lora_path"] == [loads[0]] * 2 and first["input_ids"] == [PROMPT] * 2
    assert len(continued) == 2
    reference = {v: peft_reference(tiny_model, adapters[v]) for v in (1, 2)}
    for i in range(2):
        v = got.versions[i]
        assert v == sorted(v) and set(v) == {1, 2}, v
        assert got.finished[i].completion_tokens == 24 and got.finished[i].finish_reason == "length"
        old, old_lp = got.of_version(i, 1)
        new, new_lp = got.of_version(i, 2)
        assert 1 <= len(old) <= 7  # v1's chunks not forwarded when v2 landed are dropped, never counted
        (body,) = [b for b in continued if b["input_ids"] == [*PROMPT, *old]]  # only what was forwarded
        seed = sample_seed(continuation_seed(3, i, len(old)), 0) % (1 << 31)
        assert body["lora_path"] == loads[1] and "n" not in body["sampling_params"]
        assert body["sampling_params"] == {
            **first["sampling_params"][i],
            "max_new_tokens": 24 - len(old),
            "sampling_seed": seed,
        }
        assert old_lp == pytest.approx(forward_logprobs(reference[1], PROMPT, old).tolist(), abs=1e-4)
        assert new_lp == pytest.approx(forward_logprobs(reference[2], [*PROMPT, *old], new).tolist(), abs=1e-4)
