"""The HTTP door's pure bounds (issue 32, item 2), without processes: the chat size cap and
its walk, the counting multipart reader (generated bodies cut at every place), the integer
bounds and reserved template names of the request models, and the connection counts."""

from __future__ import annotations

import asyncio
import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollwire.proxy.http.dialect.errors import HttpError, http_status
from rollwire.proxy.http.dialect.openai import RESERVED_TEMPLATE_NAMES, ChatBody, CompletionBody
from rollwire.proxy.http.dialect.prompts import PromptGate, text_bytes
from rollwire.proxy.http.edge.bodies import parse_body
from rollwire.proxy.http.edge.connections import Gate, connection_limit
from rollwire.proxy.http.edge.uploads import FormReader
from rollwire.serving.config import PROMPT_BYTES_PER_TOKEN

BOUNDARY = "b0undary"
CONTENT_TYPE = f"multipart/form-data; boundary={BOUNDARY}"
LIMITS = {"lora_name": 64, "adapter_config.json": 256, "adapter_model.safetensors": 4096}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=30,
)


def multipart(parts: dict[str, bytes] | list[tuple[str, bytes]]) -> bytes:
    out = b""
    for name, data in parts.items() if isinstance(parts, dict) else parts:
        out += f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{name}"; filename="{name}"\r\n'.encode()
        out += b"Content-Type: application/octet-stream\r\n\r\n" + data + b"\r\n"
    return out + f"--{BOUNDARY}--\r\n".encode()


def feed(body: bytes, cuts: list[int], total: int = 1 << 20) -> dict[str, bytes]:
    reader = FormReader(CONTENT_TYPE, LIMITS, total)
    edges = sorted({0, len(body), *(c % (len(body) + 1) for c in cuts)})
    for start, end in itertools.pairwise(edges):
        reader.feed(body[start:end])
    return reader.finish()


# -- the chat's size, counted before any render ------------------------------------------------
@given(json_values)
def test_text_bytes_counts_every_string_in_utf8(value):
    strings: list[str] = []

    def walk(v):
        if isinstance(v, str):
            strings.append(v)
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(k)
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)

    walk(value)
    assert text_bytes(value, 1 << 30) >= sum(len(s.encode("utf-8", "surrogatepass")) for s in strings)


def test_the_walk_stops_at_the_cap_not_at_the_body():
    many = [[] for _ in range(200_000)]
    assert 100 < text_bytes(many, 100) <= 102  # stopped just past the cap
    assert text_bytes({"content": "1" * (8 << 20)}, 1000) > 1000  # one len(), no encode of 8 MiB


def test_a_chat_over_the_fleets_prompt_is_refused_naming_the_limit():
    messages = [{"role": "user", "content": "x" * (10 * PROMPT_BYTES_PER_TOKEN + 1)}]
    with pytest.raises(Exception) as caught:
        PromptGate.check_size((messages, None, None), 10)
    assert caught.value.reason == "PROMPT_TOO_LONG" and f"{10 * PROMPT_BYTES_PER_TOKEN} bytes" in caught.value.message
    tools = [{"function": {"description": "y" * 400}}]
    with pytest.raises(Exception):
        PromptGate.check_size(([{"role": "user", "content": "hi"}], tools, None), 10)  # tools count too
    assert PromptGate.check_size(([{"role": "user", "content": "hi"}], None, {"k": "v"}), 10) < 320


async def test_a_clients_bytes_in_tokenization_are_bounded():
    from rollwire.proxy.config import HttpSection

    gate = PromptGate(HttpSection(max_tokenizing=1, tokenizing_bytes_per_client=1024), retry_after_s=1)
    release = asyncio.Event()
    loop = asyncio.get_running_loop()

    def slow() -> int:
        asyncio.run_coroutine_threadsafe(release.wait(), loop).result(5)
        return 1

    first = asyncio.create_task(gate.run("a", 800, slow))
    await asyncio.sleep(0.05)
    with pytest.raises(Exception) as caught:
        await gate.run("a", 800, lambda: 2)  # a's second chat would pass its budget
    assert caught.value.reason == "CLIENT_LIMIT"
    other = asyncio.create_task(gate.run("b", 800, lambda: 3))  # b waits for the one slot, not refused
    await asyncio.sleep(0.05)
    assert not other.done()
    release.set()
    assert await first == 1 and await other == 3
    assert not gate.pending


# -- uploads counted while read -----------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    st.binary(max_size=64),
    st.binary(max_size=256),
    st.binary(max_size=4096),
    st.lists(st.integers(min_value=0), max_size=12),
)
def test_an_upload_cut_anywhere_reads_the_same(name, config, weights, cuts):
    parts = {"lora_name": name, "adapter_config.json": config, "adapter_model.safetensors": weights}
    assert feed(multipart(parts), cuts) == parts


@settings(max_examples=40, deadline=None)
@given(st.integers(min_value=4097, max_value=20_000), st.lists(st.integers(min_value=0), max_size=8))
def test_a_part_over_its_limit_is_refused_while_it_arrives(size, cuts):
    body = multipart({"lora_name": b"a", "adapter_model.safetensors": b"w" * size})
    reader = FormReader(CONTENT_TYPE, LIMITS, 1 << 20)
    with pytest.raises(HttpError) as caught:
        for start in range(0, len(body), 1000):
            reader.feed(body[start : start + 1000])
    assert http_status(caught.value) == 413 and "adapter_model.safetensors" in caught.value.message
    assert len(reader.parts["adapter_model.safetensors"]) <= 4096 + 1000  # never more than one chunk past the limit


def test_the_total_is_counted_whatever_the_parts():
    reader = FormReader(CONTENT_TYPE, LIMITS, 500)
    with pytest.raises(HttpError) as caught:
        reader.feed(b"-" * 501)
    assert http_status(caught.value) == 413


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (multipart({"other": b"x"}), "takes only"),
        (multipart([("lora_name", b"a"), ("lora_name", b"b")]), "twice"),
    ],
)
def test_unknown_and_repeated_fields_are_refused(body, words):
    with pytest.raises(HttpError) as caught:
        feed(body, [])
    assert words in caught.value.message and http_status(caught.value) == 400


def test_an_upload_that_is_not_multipart_is_a_400():
    with pytest.raises(HttpError):
        FormReader("application/json", LIMITS, 100)


# -- integers by their wire type, reserved template names ----------------------------------------
@pytest.mark.parametrize(
    ("kind", "field", "value"),
    [
        (CompletionBody, "max_tokens", 1 << 32),
        (CompletionBody, "top_k", 1 << 32),
        (CompletionBody, "seed", 1 << 64),
        (CompletionBody, "min_tokens", 1 << 63),
        (CompletionBody, "priority", -(1 << 63) - 1),
        (CompletionBody, "prompt", [1 << 31]),
        (ChatBody, "max_completion_tokens", 1 << 32),
        (ChatBody, "max_tokens", 10**30),
    ],
)
async def test_out_of_range_integers_are_400s_naming_the_field(kind, field, value):
    base = {"model": "m", "prompt": [1]} if kind is CompletionBody else {"model": "m", "messages": [{"role": "u"}]}
    with pytest.raises(HttpError) as caught:
        await parse_body(json.dumps({**base, field: value}).encode(), kind)
    assert http_status(caught.value) == 400 and field in caught.value.message


@given(st.dictionaries(st.sampled_from(sorted(RESERVED_TEMPLATE_NAMES)), json_values, min_size=1))
@settings(max_examples=30, deadline=None)
def test_reserved_template_names_are_refused(kwargs):
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": kwargs})
    with pytest.raises(HttpError) as caught:
        asyncio.run(parse_body(body.encode(), ChatBody))
    assert http_status(caught.value) == 400 and "chat_template_kwargs" in caught.value.message


# -- connections -----------------------------------------------------------------------------------
def test_the_connection_cap_sits_below_the_descriptor_limit():
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit, seen = connection_limit(1 << 30)
    assert seen == soft and limit <= soft // 4
    assert connection_limit(3)[0] == 3


async def test_the_gate_counts_per_peer_and_releases_once():
    gate = Gate(limit=3, per_peer=2)
    a1, a2 = gate.admit("10.0.0.1"), gate.admit("10.0.0.1")
    assert a1 and a2 and gate.admit("10.0.0.1") is None  # the peer's share
    b = gate.admit("10.0.0.2")
    assert b and gate.full()
    a1.release()
    a1.release()  # idempotent
    assert gate.open == 2 and not gate.full() and gate.by_peer["10.0.0.1"] == 1
    await asyncio.wait_for(gate.wait_room(), 1)
    a2.release()
    b.release()
    assert gate.open == 0 and not gate.by_peer
