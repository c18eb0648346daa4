"""The door's text for a sample a stop string ended (issue 49, item 3): cut where the stop string
ends, as vLLM cuts it, even when the token that completed it spells more after it (byte-level BPE
tokens hold several characters), and without the stop string unless include_stop_str_in_output.
The gRPC text of the same sample stays its tokens' whole decode (rollwire.generator.detokenize)."""

from __future__ import annotations

from rollwire.proxy.http.dialect import convert
from rollwire.v1 import generator_pb2 as pb


def finished_with(texts: list[str], stop: list[str]) -> convert.Choice:
    group = convert.Group(1, stop)
    for i, text in enumerate(texts):
        message = pb.GenerateResponse()
        message.tokens.add(sample_index=0, token_ids=[i], logprobs=[-1.0], text=text, adapter_version=0)
        if i == len(texts) - 1:
            message.finished.add(sample_index=0, finish_reason=pb.FINISH_REASON_STOP, completion_tokens=len(texts))
        group.apply(message)
    return group.choices[0]


def test_a_stop_string_inside_the_last_token_cuts_the_text_where_it_ends():
    c = finished_with(["Hello", " wo", "rld!", " 😀x"], ["ld!", "d! 😀"])
    assert c.stop_reason == "ld!"  # the one that ends first
    assert c.final_text(keep_stop=True) == "Hello world!"
    assert c.final_text(keep_stop=False) == "Hello wor"


def test_a_stop_string_at_the_end_is_cut_as_before():
    c = finished_with(["a", "b", "STOP"], ["STOP"])
    assert (c.final_text(True), c.final_text(False)) == ("abSTOP", "ab")


def test_no_stop_string_in_the_text_leaves_it_whole():
    c = finished_with(["a", "b"], ["zz"])
    assert c.stop_reason is None and c.final_text(False) == "ab"
