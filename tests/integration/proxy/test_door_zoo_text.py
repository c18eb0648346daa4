"""Text through both doors over real tokenization (issue 49, item 3): one replica of a zoo model
(rollwire.demo.zoo: qwen2 with a byte-level BPE trained here, ChatML) behind a proxy with the HTTP
door. For the same seeded samples, the door's `text` (whole and as streamed deltas) equals the
gRPC `text`, and both equal `tokenizer.decode(token_ids, skip_special_tokens=True)`, on prompts of
1- to 4-byte characters at T=1, where tokens end inside characters. A stop string that a token
completes mid-way ends the sample there: gRPC keeps the token's whole decode, the door cuts its
text where the stop string ends, as vLLM does.

The engine's own rules over every architecture: tests/unit/generator/test_zoo_models.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from support.door_fleet import openai_client
from support.processes import start_generators, start_proxy, stop_all, wait_routable
from support.wire import generate

from rollwire.demo.zoo import build_model

pytestmark = pytest.mark.integration

PROMPTS = ["Héllo wörld, 日本 😀 — привет 🚀!", "🧠🤖 café ∞ 東京"]


@pytest.fixture(scope="module")
def fleet(workdir):
    from transformers import AutoTokenizer

    model = build_model("qwen2", workdir / "qwen2")
    gens = start_generators(model, workdir, ["z1"])
    proxy = start_proxy(workdir, "zp", gens, "--http-port", "0", "--http-model", str(model))
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
