"""What a proxy keeps of a group to resume it (routing/resume.py): the tokens relayed per
sample, the finished ones, and the continuation it sends. The proxy resuming a group whose
replica was SIGKILLed: tests/integration/proxy/test_proxy_resume.py."""

from __future__ import annotations

import random

from rollwire.proxy.routing.resume import Progress
from rollwire.v1 import generator_pb2 as pb


def message(chunks: dict[int, list[int]], finished=()) -> pb.GenerateResponse:
    msg = pb.GenerateResponse()
    for i, ids in chunks.items():
        msg.tokens.add(sample_index=i, token_ids=ids, logprobs=[-1.0] * len(ids))
    for i in finished:
        msg.finished.add(sample_index=i, completion_tokens=0)
    return msg


def request(n=4, max_new=32, **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(text="p", n=n, sampling=pb.SamplingParams(max_new_tokens=max_new, seed=3), **kw)


def test_the_continuation_lists_each_unfinished_sample_with_exactly_what_its_client_holds():
    rng = random.Random(1)
    req = request()
    progress = Progress(req)
    assert not progress.shown
    sent: dict[int, list[int]] = {i: [] for i in range(4)}
    done: set[int] = set()
    for _ in range(30):
        chunks = {i: [rng.randrange(100) for _ in range(rng.randrange(1, 3))] for i in range(4) if i not in done}
        ending = {i for i in chunks if rng.random() < 0.05}
        progress.observe(message(chunks, sorted(ending)))
        for i, ids in chunks.items():
            sent[i] += ids
        done |= ending
    cont = progress.continuation(req)
    assert progress.shown and sorted(progress.finished) == sorted(done)
    assert {e.sample_index: list(e.token_ids) for e in cont.resume} == {i: t for i, t in sent.items() if i not in done}
    assert cont.sampling == req.sampling and cont.text == req.text and cont.n == 4
    assert not req.resume  # the caller's request is untouched: a restart sends it as it came
    assert progress.sent() == sum(len(t) for t in sent.values())


def test_a_callers_own_resume_is_where_the_group_starts_and_where_a_restart_returns():
    req = request(resume=[pb.SampleResume(sample_index=2, token_ids=[9, 9])])
    progress = Progress(req)
    assert list(progress.runs()) == [2]
    progress.observe(message({2: [1, 2]}))
    assert [(e.sample_index, list(e.token_ids)) for e in progress.continuation(req).resume] == [(2, [9, 9, 1, 2])]
    assert progress.sent() == 2
    progress.reset()
    assert progress.tokens == {2: [9, 9]} and not progress.finished


def test_a_sample_at_its_limit_that_did_not_end_makes_the_group_unresumable():
    progress = Progress(request(n=2, max_new=3))
    progress.observe(message({0: [1, 2], 1: [1, 2, 3]}, finished=[1]))
    assert not progress.over_limit() and progress.unfinished() == [0]
    progress.observe(message({0: [3]}))
    assert progress.over_limit()


def test_nothing_is_sized_by_n_before_a_replica_started_the_group():
    """A hostile n (the replica refuses it) costs the proxy nothing: the bookkeeping holds no
    per-sample state until a replica, which bounds n by its limits, has shown the group."""
    progress = Progress(request(n=2**32 - 1))  # sized by n, this would build 2**32 entries
    assert progress.unfinished() == [] and progress.tokens == {} and not progress.over_limit()
    assert not progress.continuation(request(n=2**32 - 1)).resume
