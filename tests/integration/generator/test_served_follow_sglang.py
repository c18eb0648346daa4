"""Following on engine servers, by continuation (engines/served/follow.py): a replica over the SGLang
protocol double (tests/support/sglang_double.py) with a push landing while the double holds
the group mid-generation.

Independent computation: a PEFT model per version, teacher-forced over prompt + every token
before (the KV a continuation really has: it prefilled it under its own version)."""

from __future__ import annotations

import pytest
from support.engines import forward_logprobs
from support.follow import follow_with_push
from support.processes import start_generator
from support.sglang_double import DoubleModel, DoubleServer, Options
from support.wire import fingerprint, make_adapter, peft_reference, push

from rollwire.generator.engines.served.follow import continuation_seed
from rollwire.generator.sampling import sample_seed

PROMPT = [5, 17, 33, 40, 12]


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
