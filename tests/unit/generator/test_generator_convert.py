"""A replica's request conversion (rollwire.generator.convert), as plain functions: a GenerateRequest
becomes the GroupRequest its engine runs, or a refusal naming the field and its reason.

The engine is the real scripted engine over a config-only model folder (no model, no process);
the servers' own validation tests (tests/integration/generator/test_generator*.py) send the same refusals over gRPC.
"""

from __future__ import annotations

import json

import pytest

from rollwire.common.errors import FailedPrecondition, InvalidArgument
from rollwire.common.reasons import Reason
from rollwire.generator.config import GeneratorConfig
from rollwire.generator.convert import INLINE_TOKENIZE_CHARS, MAX_STREAM_INTERVAL, RequestConverter
from rollwire.generator.engines.embedded.scripted import ScriptedEngine
from rollwire.generator.types import SamplingParams
from rollwire.v1 import generator_pb2 as pb

VOCAB, CONTEXT = 1000, 4096


@pytest.fixture
async def convert(tmp_path) -> RequestConverter:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": VOCAB, "max_position_embeddings": CONTEXT}))
    engine = ScriptedEngine(tmp_path)
    await engine.start()
    return RequestConverter(GeneratorConfig(model=str(tmp_path), engine="scripted"), engine)


def request(**kw) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(**{"max_new_tokens": 8, **kw.pop("sampling", {})})
    return pb.GenerateRequest(**{"text": "1+1=", "n": 2, "sampling": sampling, **kw})


async def test_a_request_becomes_the_group_its_engine_runs(convert):
    group = await convert.group(
        request(sampling={"temperature": -0.0, "top_p": 0.5, "top_k": 5, "stop": ["\n"], "sample_seeds": [7, 8]}),
        "rid-1",
    )
    assert (group.request_id, group.n, group.follow, group.stream_interval) == ("rid-1", 2, False, 0)
    assert group.prompt_ids == convert.engine.tokenize("1+1=")
    assert group.sampling == SamplingParams(
        max_new_tokens=8, temperature=0.0, top_p=0.5, top_k=5, stop=("\n",), seed=None, sample_seeds=(7, 8)
    )
    long = "x" * (INLINE_TOKENIZE_CHARS + 1)  # tokenized on a worker thread: the same ids
    assert (await convert.group(request(text=long), "r")).prompt_ids == convert.engine.tokenize(long)
    ids = await convert.group(request(token_ids=pb.TokenIds(ids=[1, 2, VOCAB - 1])), "r")
    assert ids.prompt_ids == [1, 2, VOCAB - 1]


@pytest.mark.parametrize(
    ("kw", "reason"),
    [
        ({"n": 0}, Reason.BAD_N),
        ({"sampling": {"max_new_tokens": 0}}, Reason.BAD_MAX_NEW_TOKENS),
        ({"sampling": {"temperature": float("nan")}}, Reason.BAD_TEMPERATURE),
        ({"sampling": {"top_p": 0.0}}, Reason.BAD_TOP_P),
        ({"sampling": {"top_k": VOCAB + 1}}, Reason.BAD_TOP_K),
        ({"sampling": {"stop": ["x" * 65]}}, Reason.BAD_STOP),
        ({"sampling": {"seed": 1, "sample_seeds": [1, 2]}}, Reason.BAD_SEED),
        ({"group_key": "k" * 1025}, Reason.BAD_GROUP_KEY),
        ({"text": ""}, Reason.EMPTY_PROMPT),
        ({"text": "x" * 5_000_000}, Reason.PROMPT_TOO_LONG),
        ({"token_ids": pb.TokenIds(ids=[VOCAB])}, Reason.BAD_TOKEN_ID),
        ({"token_ids": pb.TokenIds(ids=[1] * CONTEXT)}, Reason.CONTEXT_TOO_LONG),
        ({"stream_interval": MAX_STREAM_INTERVAL + 1}, Reason.BAD_STREAM_INTERVAL),
        ({"adapter": pb.AdapterRef(name="a", version=2, follow=True)}, Reason.BAD_FOLLOW),
    ],
)
async def test_each_problem_is_refused_with_its_own_reason(convert, kw, reason):
    with pytest.raises(InvalidArgument) as refused:
        await convert.group(request(**kw), "r")
    assert refused.value.reason == reason and refused.value.message


@pytest.mark.parametrize(
    ("req", "reason"),
    [
        (request(adapter=pb.AdapterRef(name="a", follow=True)), Reason.FOLLOW_UNSUPPORTED),
        (request(sampling={"return_kept_tokens": True}), Reason.KEPT_TOKENS_UNSUPPORTED),
        (request(return_routed_experts=True), Reason.ROUTED_EXPERTS_UNSUPPORTED),
    ],
)
async def test_what_the_engine_cannot_honour_is_a_failed_precondition(convert, req, reason):
    with pytest.raises(FailedPrecondition, match="scripted") as refused:
        await convert.group(req, "r")
    assert refused.value.reason == reason


def test_a_text_of_wide_characters_is_measured_in_bytes_at_every_length():
    """The rule's shortcut (a text's length alone settles it when even 4 bytes a character would
    fit) must encode every other text: runs of one character of 1, 2, 3 and 4 UTF-8 bytes at
    every length from 0 to past the cap, the 4-byte runs between cap/4 and cap/3 characters
    included (over the cap in bytes, under it at 3 bytes a character)."""
    from rollwire.serving.config import PROMPT_BYTES_PER_TOKEN
    from rollwire.serving.sizes import check_prompt_size, text_over

    for tokens in (1, 3):
        cap = tokens * PROMPT_BYTES_PER_TOKEN
        for char in ("a", "é", "€", "😀"):
            width = len(char.encode())
            over = [n for n in range(cap + 2) if text_over(char * n, cap)]
            assert over == [n for n in range(cap + 2) if width * n > cap], (cap, char)
        wide = "😀" * (cap // 4 + 1)  # cap/4 < characters <= cap/3, over the cap by 4 bytes
        assert len(wide) * 3 <= cap < len(wide.encode())
        with pytest.raises(InvalidArgument) as err:
            check_prompt_size(pb.GenerateRequest(text=wide), tokens)
        assert err.value.reason == Reason.PROMPT_TOO_LONG


def test_the_prompt_size_rule_counts_utf8_bytes_and_ids_exactly_at_the_limit():
    """serving.sizes, the one rule of the replica and the proxy: generated texts of 1- to 4-byte
    characters on both sides of the cap, and id lists on both sides of the limit, against an
    independent count."""
    import random

    from rollwire.serving.config import PROMPT_BYTES_PER_TOKEN
    from rollwire.serving.sizes import check_prompt_size

    rng = random.Random(7)
    alphabet = ["a", "é", "€", "😀"]  # 1, 2, 3 and 4 UTF-8 bytes
    for tokens in (1, 2, 3, 17):
        cap = tokens * PROMPT_BYTES_PER_TOKEN
        for _ in range(200):
            text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, cap + 3)))
            over = len(text.encode()) > cap
            try:
                check_prompt_size(pb.GenerateRequest(text=text), tokens)
                refused = False
            except InvalidArgument as err:
                assert err.reason == Reason.PROMPT_TOO_LONG and f"longer than {cap} bytes" in err.message
                refused = True
            assert refused == over, (tokens, len(text), len(text.encode()))
        for n in (tokens - 1, tokens, tokens + 1):
            req = pb.GenerateRequest()
            req.token_ids.ids.extend([5] * n)
            if n <= tokens:
                check_prompt_size(req, tokens, "any replica of this fleet")
                continue
            with pytest.raises(InvalidArgument) as err:
                check_prompt_size(req, tokens, "any replica of this fleet")
            assert err.value.message == f"the prompt has {n} tokens; any replica of this fleet accepts at most {tokens}"


def test_finishes_carrying_routing_are_cut_into_messages_that_fit():
    """types.by_routed_size: runs keep the events' order, each run's routing is within the limit
    (one finish over it alone), and events without routing stay in one run."""
    import random

    from rollwire.generator.types import RoutedExperts, SampleDone, TokenDelta, by_routed_size

    rng = random.Random(5)
    for _ in range(200):
        events = []
        for i in range(rng.randint(0, 12)):
            if rng.random() < 0.4:
                events.append(TokenDelta(i, [1], [-0.1], "a", 1))
            else:
                size = rng.choice([0, 1, 30, 60, 99, 100, 101, 250])
                routed = RoutedExperts(size // 2, 1, 1, b"x" * size) if size else None
                events.append(SampleDone(i, "length", 3, 1, routed))
        runs = by_routed_size(events, limit=100)
        assert [e for run in runs for e in run] == events and all(runs[1:])
        for run in runs:
            sizes = [len(e.routed.expert_ids) for e in run if isinstance(e, SampleDone) and e.routed]
            assert sum(sizes) <= 100 or len(sizes) == 1
        if not any(isinstance(e, SampleDone) and e.routed for e in events):
            assert len(runs) == 1
