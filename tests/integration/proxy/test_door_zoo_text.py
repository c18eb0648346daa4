"""Text through both doors over real tokenization (issue 49, item 3): one replica of a zoo model
(rollwire.demo.zoo: qwen3_moe with a byte-level BPE trained here, ChatML) behind a proxy with the HTTP
door. For the same seeded samples, the door's `text` (whole and as streamed deltas) equals the
gRPC `text`, and both equal `tokenizer.decode(token_ids, skip_special_tokens=True)`, on prompts of
1- to 4-byte characters at T=1, where tokens end inside characters. A stop string that a token
completes mid-way ends the sample there: gRPC keeps the token's whole decode, the door cuts its
text where the stop string ends, as vLLM does.

The door is started with http.return_routed_experts (vLLM's --enable-return-routed-experts), so
its unstreamed answers carry each sample's MoE routing (issue 49, item 4): checked against the
router's own top-k in a teacher-forced forward, on /v1/completions and /inference/v1/generate,
with and without routed_experts_prompt_start.

The engine's own rules over every architecture: tests/unit/generator/test_zoo_models.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from support.door_fleet import openai_client, post
from support.processes import start_generators, start_proxy, stop_all, wait_routable
from support.wire import generate

from rollwire.demo.zoo import build_model

pytestmark = pytest.mark.integration

PROMPTS = ["Héllo wörld, 日本 😀 — привет 🚀!", "🧠🤖 café ∞ 東京"]


@pytest.fixture(scope="module")
def fleet(workdir):
    from transformers import AutoTokenizer

    model = build_model("qwen3_moe", workdir / "qwen3_moe")
    gens = start_generators(model, workdir, ["z1"])
    routed = ("--set", "http.return_routed_experts=true")
    proxy = start_proxy(workdir, "zp", gens, "--http-port", "0", "--http-model", str(model), *routed)
    try:
        wait_routable(proxy, gens)
        yield proxy, model, AutoTokenizer.from_pretrained(model)
    finally:
        stop_all([proxy, *gens])


def door_texts(proxy, model, prompt: str, stream: bool, **body) -> tuple[dict[int, str], dict[int, list[int]]]:
    """The door's text and token ids of each sample, whole or from its streamed deltas."""
    client = openai_client(proxy.http_url)
    extra = {"return_token_ids": True, "ignore_eos": True, **body.pop("extra_body", {})}
    params: dict[str, Any] = dict(n=4, seed=13, max_tokens=20, temperature=1.0) | body
    got: Any = client.completions.create(model=model.name, prompt=prompt, stream=stream, extra_body=extra, **params)
    texts: dict[int, str] = {}
    ids: dict[int, list[int]] = {}
    for choices in [e.choices for e in got] if stream else [got.choices]:
        for c in choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            ids.setdefault(c.index, []).extend((c.model_extra or {}).get("token_ids") or [])
    return texts, ids


@pytest.mark.parametrize("prompt", PROMPTS)
def test_both_doors_send_the_decode_of_the_samples_tokens(fleet, prompt):
    proxy, model, tok = fleet
    want = generate(proxy.target, prompt, n=4, seed=13, max_new_tokens=20, temperature=1.0, ignore_eos=True)
    for i, ids in want.tokens.items():
        assert want.text[i] == tok.decode(ids, skip_special_tokens=True), i
    for stream in (False, True):
        texts, ids = door_texts(proxy, model, prompt, stream)
        assert ids == want.tokens and texts == want.text, stream


def test_a_stop_string_inside_a_token_ends_the_sample_and_the_door_cuts_there(fleet):
    proxy, model, tok = fleet
    free = generate(proxy.target, PROMPTS[0], n=1, seed=21, max_new_tokens=24, temperature=1.0, ignore_eos=True)
    ids = free.tokens[0]
    pieces = [tok.decode(ids[:k], skip_special_tokens=True) for k in range(len(ids) + 1)]
    # a one-character stop string that a token of several characters holds before its last one
    found = next(
        ((k, pieces[k][len(pieces[k - 1])]) for k in range(2, len(ids))
         if len(pieces[k]) - len(pieces[k - 1]) >= 2 and pieces[k].startswith(pieces[k - 1])
         and pieces[k][len(pieces[k - 1])] not in pieces[k - 1] + "\ufffd"),
        None,
    )  # fmt: skip
    if found is None:
        pytest.skip("no token of several characters to stop inside")
    k, stop = found
    got = generate(
        proxy.target, PROMPTS[0], n=1, seed=21, max_new_tokens=24, temperature=1.0, ignore_eos=True, stop=[stop]
    )
    assert got.tokens[0] == ids[:k] and got.text[0] == pieces[k]  # gRPC: the whole decode of its tokens
    before = len(pieces[k - 1])  # the door: cut where the stop string ends (before it by default), as vLLM
    for stream in (False, True):
        texts, _ = door_texts(proxy, model, PROMPTS[0], stream, stop=[stop], seed=21, n=1, max_tokens=24)
        assert texts[0] == pieces[k][:before], stream
        kept = {"include_stop_str_in_output": True}
        texts, _ = door_texts(
            proxy, model, PROMPTS[0], stream, stop=[stop], seed=21, n=1, max_tokens=24, extra_body=kept
        )
        assert texts[0] == pieces[k][: before + 1], stream


def routed_array(b64: str):
    import base64
    import io

    import numpy as np

    return np.load(io.BytesIO(base64.b64decode(b64)), allow_pickle=False)


def test_unstreamed_answers_carry_the_routing_of_every_forwarded_position(fleet):
    """vLLM's routed_experts: [prompt + completion - 1 positions, MoE layers, top_k], less the first
    routed_experts_prompt_start positions; each row the router's top-k for that position."""
    import torch
    from transformers import AutoModelForCausalLM

    proxy, model, tok = fleet
    reference = AutoModelForCausalLM.from_pretrained(model).eval()
    k = reference.config.num_experts_per_tok

    def router_choices(ids: list[int]):
        with torch.no_grad():
            out = reference(input_ids=torch.tensor([ids]), output_router_logits=True)
        return torch.stack([torch.topk(lg.softmax(-1), k, -1).indices for lg in out.router_logits], 1).numpy()

    prompt = tok(PROMPTS[0], add_special_tokens=False).input_ids
    for start in (0, 3):
        client = openai_client(proxy.http_url)
        extra = {"return_token_ids": True, "ignore_eos": True, "routed_experts_prompt_start": start}
        got: Any = client.completions.create(
            model=model.name, prompt=prompt, n=2, seed=5, max_tokens=8, temperature=1.0, extra_body=extra
        )
        for c in got.choices:
            ids = prompt + c.model_extra["token_ids"]
            routed = routed_array(c.model_extra["routed_experts"])
            assert routed.dtype.kind == "u" and routed.shape[1:] == (reference.config.num_hidden_layers, k)
            assert (routed == router_choices(ids[:-1])[start:]).all(), start
    body = {"model": model.name, "token_ids": prompt, "sampling_params": {"max_tokens": 6, "seed": 9}}
    answer = post(proxy.http_url, "/inference/v1/generate", body).json()
    (c,) = answer["choices"]
    assert (routed_array(c["routed_experts"]) == router_choices(prompt + c["token_ids"][:-1])).all()
    from rollwire.client import Client

    with Client(proxy.target) as sdk:  # the gRPC door, through the proxy: the SDK's Sample.routed_experts
        result = sdk.generate(prompt, n=2, max_new_tokens=6, seed=3, return_routed_experts=True)
    for sample in result.samples:
        assert sample.routed_experts is not None
        assert (sample.routed_experts.array() == router_choices(prompt + sample.token_ids[:-1])).all()
    streamed = openai_client(proxy.http_url).completions.create(
        model=model.name, prompt=prompt, max_tokens=4, stream=True, extra_body={"ignore_eos": True}
    )
    assert all("routed_experts" not in (e.choices[0].model_extra or {}) for e in streamed)  # whole answers only
