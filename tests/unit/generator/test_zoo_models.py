"""Real architectures (issue 49): the embedded engine over the model zoo (rollwire.demo.zoo: tiny
random llama, qwen2, qwen3, mistral, gemma2/gemma3 with sliding windows, phi3, olmo2, gpt2,
gpt_neox, qwen3_moe, mixtral; one byte-level BPE tokenizer trained here, ChatML template).

Per architecture, in this process (no replica started: the engine is what is tested):
- a seeded T=1 group's logprobs equal a teacher-forced forward of the base model, and with the
  adapter PEFT writes for it (all-linear; the attention projections of a MoE model; with a
  rank_pattern and an alpha_pattern, rsLoRA on every other architecture) those of the PeftModel
  holding it, within 1e-4; the push checks (the replica's and the proxy's, one
  function) accept that adapter against the layers derived from the model's own modules;
- every sample's streamed text, concatenated, is `tokenizer.decode(ids, skip_special_tokens=True)`;
  across the zoo the generated texts hold 1- to 4-byte characters and special tokens.
Refused by name: a MoE model's expert and router LoRA (PEFT's target_parameters), modules_to_save.
"""

from __future__ import annotations

from typing import Any

import pytest
import pytest_asyncio
import torch
from support.engines import collect, forward_logprobs
from support.zoo import ARCHS, MOE, attention_targets, peft_adapter

from rollwire.common.errors import InvalidArgument
from rollwire.demo.zoo import build_zoo
from rollwire.generator.engines.embedded import transformers_engine as te
from rollwire.generator.shapes import base_linear_shapes
from rollwire.generator.types import AdapterSelection, GroupRequest, SamplingParams
from rollwire.push.checks import check_payload

TOL = 1e-4
PROMPT = [{"role": "user", "content": "Héllo wörld, 日本 😀 — привет 🚀!"}]
SEEN: dict[str, set] = {"bytes": set(), "special": set()}
"""What the generated texts held, over every architecture (checked by the last test)."""


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return build_zoo(tmp_path_factory.mktemp("zoo"))


@pytest_asyncio.fixture(scope="module", params=ARCHS)
async def arch(request, zoo):
    """(name, model folder, engine) of one architecture, its engine started once."""
    engine = te.TransformersEngine(zoo[request.param], max_batch_rows=16, threads=1)
    await engine.start()
    yield request.param, zoo[request.param], engine
    await engine.close()


def group(engine, adapter: AdapterSelection = AdapterSelection(), **sampling) -> GroupRequest:
    prompt = engine.tokenize(engine.tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False))
    params: dict[str, Any] = dict(max_new_tokens=24, temperature=1.0, seed=7, ignore_eos=True) | sampling
    return GroupRequest("zoo", prompt, 4, SamplingParams(**params), adapter)


def check_text(engine, out: dict) -> None:
    """Each sample's text is the decode of its ids; note what the texts held."""
    specials = set(engine.tokenizer.all_special_ids)
    for i, ids in out["tokens"].items():
        assert out["text"][i] == engine.tokenizer.decode(ids, skip_special_tokens=True), i
        SEEN["bytes"] |= {len(c.encode()) for c in out["text"][i]}
        SEEN["special"] |= specials & set(ids)


def assert_logprobs(reference, g: GroupRequest, out: dict) -> float:
    worst = 0.0
    for i, ids in out["tokens"].items():
        want = forward_logprobs(reference, g.prompt_ids, ids)
        worst = max(worst, float((torch.tensor(out["logprobs"][i]) - want).abs().max()))
    assert worst < TOL
    return worst


async def test_base_logprobs_and_text(arch):
    _, folder, engine = arch
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    g = group(engine)
    out = await collect(engine, g)
    assert sorted(out["done"]) == [0, 1, 2, 3] and all(len(t) == 24 for t in out["tokens"].values())
    assert_logprobs(reference, g, out)
    check_text(engine, out)


async def test_the_adapter_peft_writes_is_accepted_and_served_exactly(arch):
    name, folder, engine = arch
    attention = attention_targets(name)
    targets = attention if name in MOE else "all-linear"
    rslora = ARCHS.index(name) % 2 == 1
    adapter = peft_adapter(  # a rank_pattern and an alpha_pattern, as PEFT matches them
        folder,
        seed=3,
        target_modules=targets,
        lora_alpha=16,
        use_rslora=rslora,
        rank_pattern={attention[0]: 4},
        alpha_pattern={attention[-1]: 3.0},
    )
    assert adapter.shape.rank_pattern and adapter.shape.alpha_pattern
    manifest = adapter.manifest(f"zoo-{name}")
    check_payload(manifest, adapter.payload, base_linear_shapes(folder))  # the push's checks, replica and proxy
    handle = f"{name}-1"
    await engine.load_adapter(handle, manifest, adapter.payload)
    try:
        g = group(engine, AdapterSelection(manifest.name, 1, handle), seed=11, temperature=0.9, top_k=40)
        out = await collect(engine, g)
        with torch.no_grad(), adapter.model.disable_adapter():
            base_only = forward_logprobs(adapter.model, g.prompt_ids, out["tokens"][0], 0.9, 40)
        with torch.no_grad():
            with_lora = forward_logprobs(adapter.model, g.prompt_ids, out["tokens"][0], 0.9, 40)
        assert (with_lora - base_only).abs().max() > 1e-2  # the adapter really changes the numbers
        for i, ids in out["tokens"].items():
            want = forward_logprobs(adapter.model, g.prompt_ids, ids, 0.9, 40)
            assert (torch.tensor(out["logprobs"][i]) - want).abs().max() < TOL, i
        check_text(engine, out)
    finally:
        await engine.unload_adapter(handle)


async def test_a_stop_string_across_token_seams_ends_the_sample_at_the_token_completing_it(arch):
    _, _, engine = arch
    free = await collect(engine, group(engine, seed=5, max_new_tokens=32))
    ids = free["tokens"][0]
    pieces = [engine.tokenizer.decode(ids[:k], skip_special_tokens=True) for k in range(len(ids) + 1)]
    stop = next((span for k in range(len(ids) // 4, len(ids)) if (span := seam_span(pieces, k))), None)
    if stop is None:
        pytest.skip("the sample's text has no clean span to stop on")
    end = next(k for k in range(len(pieces)) if stop in pieces[k])  # the first token whose text completes it
    out = await collect(engine, group(engine, seed=5, max_new_tokens=32, stop=(stop,)))
    assert out["done"][0].reason == "stop"
    assert out["tokens"][0] == ids[:end]
    assert out["text"][0] == pieces[end]  # the whole decode, whatever the last token spells after the stop


def router_choices(model, ids: list[int]) -> torch.Tensor:
    """[positions, MoE layers, top_k]: each position's top_k experts by the router's own logits
    (output_router_logits) in a teacher-forced forward: computed apart from the engine's hook."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    return torch.stack([torch.topk(lg.float().softmax(-1), k, -1).indices for lg in out.router_logits], 1)


async def test_routed_experts_are_the_routers_choices_for_every_forwarded_position(arch, monkeypatch):
    """Routing replay (issue 49 item 4): each sample's RoutedExperts covers its prompt and its
    tokens but the last, and equals the router's top-k of a teacher-forced forward; a second
    run of the prompt (a prefix-cache hit otherwise) and a resumed sample report it whole."""
    from rollwire.common.errors import FailedPrecondition
    from rollwire.common.reasons import Reason
    from rollwire.generator.engines.embedded import routing

    name, folder, engine = arch
    g = group(engine, max_new_tokens=12)
    g.routed_experts = True
    if name not in MOE:
        with pytest.raises(FailedPrecondition) as err:
            engine.check(g)
        assert err.value.reason == Reason.ROUTED_EXPERTS_UNSUPPORTED and "no MoE layers" in err.value.message
        return
    from transformers import AutoModelForCausalLM

    from rollwire.generator.types import GroupRequest as Group

    reference = AutoModelForCausalLM.from_pretrained(folder).eval()

    def check(out: dict, have: dict[int, list[int]]) -> None:
        for i, done in out["done"].items():
            ids = g.prompt_ids + have.get(i, []) + out["tokens"][i]
            routed = done.routed
            assert routed is not None and routed.positions == len(ids) - 1
            got = torch.frombuffer(bytearray(routed.expert_ids), dtype=torch.int16)
            got = got.view(routed.positions, routed.layers, routed.top_k).long()
            assert routed.top_k == reference.config.num_experts_per_tok
            assert torch.equal(got, router_choices(reference, ids[:-1])), (name, i)

    out = await collect(engine, g)
    check(out, {})
    check(await collect(engine, g), {})  # its prompt is in the prefix cache now
    have = {2: out["tokens"][2][:5]}
    check(
        await collect(engine, Group("zoo-resume", g.prompt_ids, 4, g.sampling, resume=have, routed_experts=True)), have
    )
    plain = await collect(engine, group(engine, max_new_tokens=4))
    assert all(d.routed is None for d in plain["done"].values())  # only when asked
    per_sample = (len(g.prompt_ids) + 12) * engine._routing.bytes_per_position()
    monkeypatch.setattr(routing, "MAX_ROUTED_BYTES", per_sample)
    engine.check(g)  # exactly at the limit: served
    monkeypatch.setattr(routing, "MAX_ROUTED_BYTES", per_sample - 1)  # one byte less: refused before any work
    with pytest.raises(InvalidArgument) as too_large:
        engine.check(g)
    assert too_large.value.reason == Reason.ROUTED_EXPERTS_TOO_LARGE and str(per_sample) in too_large.value.message


def seam_span(pieces: list[str], k: int) -> str | None:
    """Three characters of the text across the seam after token k (one before it, two after),
    with no replacement character, found nowhere earlier: a stop string no single token spells."""
    text, start = pieces[-1], len(pieces[k])
    span = text[start - 1 : start + 2]
    if start < 1 or not text.startswith(pieces[k]) or len(span) < 3 or "\ufffd" in span or span in text[: start + 1]:
        return None
    return span


def test_generated_texts_held_characters_of_every_width_and_special_tokens():
    """Across the zoo's generations (the tests above, which ran first): 1- to 4-byte characters and
    special tokens, so the text checks covered byte-split UTF-8 and specials mid-stream."""
    if not SEEN["bytes"]:
        pytest.skip("run with the tests above")
    assert SEEN["bytes"] >= {1, 2, 3, 4}, SEEN
    assert SEEN["special"], SEEN


# -- refused by name ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(MOE))
def test_expert_and_router_lora_is_refused_by_name(zoo, name):
    adapter = peft_adapter(zoo[name], seed=4, target_modules="all-linear")
    with pytest.raises(InvalidArgument, match=r"MoE (model's expert weights|router).*instead of 'all-linear'"):
        check_payload(adapter.manifest(), adapter.payload, base_linear_shapes(zoo[name]))


def test_modules_to_save_is_refused_by_name(zoo):
    adapter = peft_adapter(zoo["llama"], seed=5, target_modules=["q_proj"], modules_to_save=["lm_head"])
    with pytest.raises(InvalidArgument, match="modules_to_save"):
        check_payload(adapter.manifest(), adapter.payload, base_linear_shapes(zoo["llama"]))


def test_pattern_keys_beyond_names_and_suffixes_are_refused_by_name():
    from rollwire.common.errors import RequestError
    from rollwire.common.lora import LoraShape
    from rollwire.common.manifest import Manifest, check_manifest
    from rollwire.common.reasons import Reason

    config = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], "rank_pattern": {"(a+)+$": 4}}
    with pytest.raises(RequestError, match="not a module name or dotted name suffix"):
        LoraShape.from_peft(config)
    for shape in (
        LoraShape(8, 16.0, ("q_proj",), rank_pattern=(("q|k", 4.0),)),
        LoraShape(8, 16.0, ("q_proj",), rank_pattern=(("q_proj", 2.5),)),
        LoraShape(8, 16.0, ("q_proj",), alpha_pattern=(("q_proj", float("nan")),)),
    ):
        with pytest.raises(InvalidArgument) as err:
            check_manifest(Manifest("a", 1, "fp", shape, 10, "0" * 64), fingerprint="fp", max_bytes=100)
        assert err.value.reason == Reason.BAD_LORA_CONFIG and "pattern" in err.value.message


def test_served_engines_write_patterns_for_vllm_and_sglang_refuses_them_by_name(zoo, tmp_path):
    """vLLM's PEFTHelper reads rank_pattern and alpha_pattern from adapter_config.json, so the vllm
    engine's folder carries them as PEFT wrote them; SGLang keeps one r and alpha per adapter, so
    the sglang engine refuses such a push before SGLang is touched."""
    from rollwire.common.errors import FailedPrecondition
    from rollwire.generator.engines.served.files import peft_config
    from rollwire.generator.engines.served.sglang_engine import SGLangEngine
    from rollwire.generator.engines.served.vllm_engine import VLLMEngine
    from rollwire.generator.engines.settings import SGLangSection, VLLMSection

    adapter = peft_adapter(zoo["qwen2"], seed=6, target_modules="all-linear", rank_pattern={"q_proj": 4})
    manifest = adapter.manifest()
    config = peft_config(manifest, adapter.payload, str(zoo["qwen2"]))
    assert config["rank_pattern"] == {"q_proj": 4} and config["alpha_pattern"] == {} and config["r"] == 8
    VLLMEngine(tmp_path, VLLMSection(), adapter_window=2)._check_adapter(manifest)
    with pytest.raises(FailedPrecondition, match="rank_pattern or alpha_pattern"):
        SGLangEngine(tmp_path, SGLangSection(), adapter_window=2)._check_adapter(manifest)


def test_a_server_without_lora_for_the_model_class_is_named_at_start():
    """vLLM 0.32 has no LoRA for GPT-2 (no SupportsLoRA): launched with --enable-lora, its worker
    fails with this line deep in its log (the tail shows the engine core's generic failure);
    the replica's start-up error names it (measured on the zoo's gpt2: 106 s to fail)."""
    from rollwire.generator.engines.served.process import known_cause

    log = (
        "(Worker pid=30935) ERROR 12-07 17:17:47 [multiproc_executor.py:953] ValueError: GPT2LMHeadModel does "
        "not support LoRA yet.\n" + "RuntimeError: Engine core initialization failed. See root cause above.\n" * 30
    )
    cause = known_cause("vLLM", log)
    assert "GPT2LMHeadModel" in cause and "--engine transformers" in cause
    assert known_cause("vLLM", "RuntimeError: out of memory") == ""


@pytest.mark.parametrize(("config", "named"), [({"use_dora": True}, "DoRA"), ({"lora_bias": True}, "LoRA bias")])
def test_dora_and_lora_bias_are_refused_by_name(zoo, config, named):
    adapter = peft_adapter(zoo["qwen3"], seed=7, target_modules=["q_proj", "v_proj"], **config)
    with pytest.raises(InvalidArgument, match=named):
        check_payload(adapter.manifest(), adapter.payload, base_linear_shapes(zoo["qwen3"]))
