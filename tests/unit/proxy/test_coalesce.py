"""The proxy's coalescer in-process (proxy/routing/coalesce.py): which requests merge, what the merged
group asks for, and that each request keeps its own answer, deadline and cancellation. The
group runner is a stand-in that records what it was asked and plays a scripted stream (the
logic under test is the coalescer's, not a replica's); tests/integration/proxy/test_door_loads.py runs the
real thing through a proxy and a replica."""

from __future__ import annotations

import asyncio
import time

import pytest

from rollwire.common.errors import DeadlineExceeded, Unavailable
from rollwire.proxy.routing.coalesce import Coalescer
from rollwire.v1 import generator_pb2 as pb


def request(rid: str, seed: int | None = None, prompt=(1, 2, 3), **sampling) -> pb.GenerateRequest:
    r = pb.GenerateRequest(n=1, request_id=rid, sampling=pb.SamplingParams(max_new_tokens=4, **sampling))
    r.token_ids.ids.extend(prompt)
    if seed is not None:
        r.sampling.seed = seed
    return r


class Runner:
    """Records each group it is asked to run and streams started, one token per sample, finished."""

    def __init__(self, hold: asyncio.Event | None = None, fail: Exception | None = None):
        self.groups: list[pb.GenerateRequest] = []
        self.hold, self.fail, self.cancelled = hold, fail, False

    async def __call__(self, group: pb.GenerateRequest, deadline: float):
        self.groups.append(group)
        try:
            yield pb.GenerateResponse(started=pb.GenerationStarted(request_id=group.request_id))
            if self.hold is not None:
                await self.hold.wait()
            if self.fail is not None:
                raise self.fail
            msg = pb.GenerateResponse()
            for i in range(group.n):
                msg.tokens.add(sample_index=i, token_ids=[100 + i], logprobs=[-0.5])
                msg.finished.add(sample_index=i)
            yield msg
        except asyncio.CancelledError:
            self.cancelled = True
            raise


def coalescer(window_s=0.05, max_n=8, engines=("transformers",)) -> tuple[Coalescer, list[int]]:
    merged: list[int] = []
    return Coalescer(window_s, lambda: max_n, lambda: set(engines), merged.append), merged


async def drain(c: Coalescer, req: pb.GenerateRequest, run, deadline_s: float = 10) -> list[pb.GenerateResponse]:
    return [m async for m in c.events(req, time.monotonic() + deadline_s, run)]


async def test_concurrent_requests_for_one_prompt_run_as_one_group_each_with_its_own_sample():
    c, merged = coalescer()
    run = Runner()
    reqs = [request("a", seed=11), request("b", seed=22), request("c")]
    answers = await asyncio.gather(*(drain(c, r, run) for r in reqs))
    assert len(run.groups) == 1 and merged == [3]
    group = run.groups[0]
    assert group.n == 3 and not group.sampling.HasField("seed")
    assert list(group.sampling.sample_seeds)[:2] == [11, 22]  # the unseeded one drew a fresh seed
    for i, (req, answer) in enumerate(zip(reqs, answers, strict=True)):
        assert answer[0].started.request_id == req.request_id
        tokens = [t for m in answer for t in m.tokens]
        assert [(t.sample_index, list(t.token_ids)) for t in tokens] == [(0, [100 + i])]
        assert [f.sample_index for m in answer for f in m.finished] == [0]


async def test_unseeded_requests_merge_without_seeds_and_differences_keep_groups_apart():
    c, _ = coalescer()
    run = Runner()
    reqs = [request("a"), request("b"), request("c", temperature=0.5), request("d", prompt=(9,))]
    await asyncio.gather(*(drain(c, r, run) for r in reqs))
    sizes = sorted(g.n for g in run.groups)
    assert sizes == [1, 1, 2]
    assert all(not g.sampling.sample_seeds for g in run.groups)


async def test_no_request_waits_longer_than_the_window_and_a_full_group_starts_at_once():
    c, _ = coalescer(window_s=0.2, max_n=2)
    run = Runner()
    start = time.monotonic()
    await asyncio.gather(drain(c, request("a"), run), drain(c, request("b"), run))
    assert time.monotonic() - start < 0.15  # full at 2: it did not wait for the window
    c, _ = coalescer(window_s=0.1, max_n=8)
    start = time.monotonic()
    await drain(c, request("alone"), Runner())
    assert 0.09 <= time.monotonic() - start < 1.0  # alone: the window, then it runs unmerged


async def test_seeded_requests_are_not_merged_where_a_replica_cannot_seed_each_sample():
    c, _ = coalescer(engines=("transformers", "vllm"))
    assert not c.accepts(request("a", seed=1)) and c.accepts(request("b"))
    assert not coalescer(window_s=0)[0].accepts(request("c"))
    follow = request("d")
    follow.adapter.name, follow.adapter.follow = "pol", True
    many = request("e")
    many.n = 2
    assert not c.accepts(follow) and not c.accepts(many)


async def test_a_cancelled_request_ends_only_itself_and_the_last_one_ends_the_group():
    c, _ = coalescer()
    hold = asyncio.Event()
    run = Runner(hold)
    deadline = time.monotonic() + 10
    first, second = c.events(request("a"), deadline, run), c.events(request("b"), deadline, run)
    t1 = asyncio.ensure_future(anext(first))
    t2 = asyncio.ensure_future(anext(second))
    assert (await t1).started.request_id == "a" and (await t2).started.request_id == "b"
    await first.aclose()  # a caller goes away mid-group
    assert not run.cancelled
    hold.set()
    rest = [m async for m in second]
    assert [f.sample_index for m in rest for f in m.finished] == [0]
    hold2 = asyncio.Event()
    run2 = Runner(hold2)
    a, b = c.events(request("c"), deadline, run2), c.events(request("d"), deadline, run2)
    await asyncio.gather(anext(a), anext(b))
    await a.aclose()
    await b.aclose()
    await asyncio.sleep(0)
    assert run2.cancelled  # nobody reads it any more: the group is cancelled


async def test_each_request_keeps_its_own_deadline_and_a_group_failure_is_everyones_answer():
    c, _ = coalescer()
    hold = asyncio.Event()
    run = Runner(hold)
    short = c.events(request("short"), time.monotonic() + 0.3, run)
    long = c.events(request("long"), time.monotonic() + 10, run)
    long_task = asyncio.ensure_future(anext(long))
    with pytest.raises(DeadlineExceeded):
        async for _ in short:
            pass
    await long_task
    hold.set()
    assert [f.sample_index for m in [x async for x in long] for f in m.finished] == [0]
    failing = Runner(fail=Unavailable("the replica died", reason="REPLICA_FAILED"))
    results = await asyncio.gather(
        drain(c, request("x"), failing), drain(c, request("y"), failing), return_exceptions=True
    )
    assert all(isinstance(r, Unavailable) for r in results)
