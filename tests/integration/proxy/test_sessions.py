"""Multi-turn sessions through a real proxy and real replicas of the tiny model (issue 25).

What is checked: a 4-turn session's tokens and logprobs equal one teacher-forced pass of the
model over the whole episode (no re-tokenization drift); turns stick to one replica and a
replica SIGKILLed mid-episode costs the episode nothing; hostile session fields get their
status codes while a well-behaved session beside them goes on; the prefix policy sends a
prompt that extends an earlier one to the replica that served it (scraped metrics).
"""

from __future__ import annotations

import random
import uuid

import grpc
import pytest
import requests
import torch
from support.processes import start_generators, start_proxy, stop_all, wait_routable
from support.wire import fingerprint, make_adapter, metric_value, push

from rollwire.client import Client, InvalidArgument, ResourceExhausted
from rollwire.client._requests import build_generate_request
from rollwire.common.errors import from_rpc_error
from rollwire.common.reasons import Reason
from rollwire.v1 import generator_pb2 as pb
from rollwire.v1 import generator_pb2_grpc

pytestmark = pytest.mark.integration  # replicas and proxies: not for make test-fast
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True, "seed": 7}
VOCAB = 100  # the tiny model's


@pytest.fixture(scope="module")
def replicas(tiny_model, workdir):
    services = start_generators(tiny_model, workdir, ["s1", "s2"])
    yield services
    stop_all(services)


@pytest.fixture(scope="module")
def proxy(replicas, workdir, tiny_model):
    svc = start_proxy(
        workdir, "sproxy", replicas, "--policy", "prefix", "--http-port", "0", "--http-model", str(tiny_model)
    )
    wait_routable(svc, replicas)
    yield svc
    stop_all([svc])


def env_tokens(rng: random.Random, k: int = 5) -> list[int]:
    """An environment's answer: token ids the model did not write."""
    return [rng.randrange(3, VOCAB) for _ in range(k)]


def play(client: Client, turns: int, rng: random.Random, **options):
    """One episode: a prompt, then the model and the environment taking turns."""
    session = client.session(**{**GREEDY, **options})
    replies = [session.turn(env_tokens(rng, 8))]
    for _ in range(turns - 1):
        replies.append(session.turn(env_tokens(rng)))
    return session, replies


def teacher_forced(model, history: list[int], mask: list[int]) -> tuple[list[int], list[float]]:
    """Independent computation: one forward pass over the whole episode; for each model token,
    the greedy choice at its position and that choice's log-softmax."""
    with torch.no_grad():
        logits = model(torch.tensor([history])).logits[0]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    positions = [i for i, m in enumerate(mask) if m]
    return [int(logprobs[i - 1].argmax()) for i in positions], [float(logprobs[i - 1, history[i]]) for i in positions]


def test_a_four_turn_session_equals_one_pass_over_the_whole_episode(proxy, reference_model):
    with Client(proxy.target) as client:
        session, replies = play(client, 4, random.Random(1))
        history, mask = session.history, session.loss_mask
        assert [r.prompt_token_ids for r in replies][-1] == history[: -len(replies[-1].token_ids)]
        model_tokens = [t for r in replies for t in r.token_ids]
        assert [t for t, m in zip(history, mask, strict=True) if m] == model_tokens
        greedy, logprobs = teacher_forced(reference_model, history, mask)
        assert greedy == model_tokens
        got = [lp for r in replies for lp in r.logprobs]
        assert max(abs(a - b) for a, b in zip(got, logprobs, strict=True)) < 1e-4
        # the same whole sequence sent sessionless gives the last turn's tokens again
        last = len(replies[-1].token_ids)
        alone = client.generate(history[:-last], **GREEDY).samples[0]
        assert alone.token_ids == replies[-1].token_ids
        assert max(abs(a - b) for a, b in zip(alone.logprobs, replies[-1].logprobs, strict=True)) < 1e-4


def test_turns_stick_to_one_replica(proxy):
    before = proxy.metrics()
    with Client(proxy.target) as client:
        _, replies = play(client, 4, random.Random(2))
    assert len({r.replica for r in replies}) == 1
    after = proxy.metrics()
    sticky = 'rollwire_proxy_session_routes_total{outcome="sticky"}'
    assert metric_value(after, sticky) - metric_value(before, sticky) == 3


def test_a_replica_called_directly_keeps_its_own_sessions(replicas, reference_model):
    with Client(replicas[0].target) as client:
        session, replies = play(client, 3, random.Random(3))
    greedy, _ = teacher_forced(reference_model, session.history, session.loss_mask)
    assert greedy == [t for r in replies for t in r.token_ids]
    assert metric_value(replicas[0].metrics(), 'rollwire_generator_session_turns_total{outcome="completed"}') >= 3


def raw_turn(stub, sid: str, ids: list[int], n: int = 1, max_new_tokens: int = 4, expect: int = 0):
    req = pb.GenerateRequest(
        n=n,
        token_ids=pb.TokenIds(ids=ids),
        sampling=pb.SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True),
    )
    req.session.id, req.session.expect_tokens = sid, expect
    return stub.Generate(req, timeout=30)


def refusal(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    err = from_rpc_error(info.value)
    return err.code, err.reason


@pytest.mark.parametrize("sid", ["", "a b", "x" * 129, "ids/with/slashes", "é"])
def test_bad_session_ids_are_refused(proxy, sid):
    with grpc.insecure_channel(proxy.target) as channel:
        stub = generator_pb2_grpc.GeneratorServiceStub(channel)
        assert refusal(raw_turn(stub, sid, [5, 6])) == (grpc.StatusCode.INVALID_ARGUMENT, Reason.BAD_SESSION)


def test_hostile_turns_get_their_status_and_a_good_session_beside_them_goes_on(proxy):
    rng = random.Random(4)
    with Client(proxy.target) as client, grpc.insecure_channel(proxy.target) as channel:
        stub = generator_pb2_grpc.GeneratorServiceStub(channel)
        good = client.session(**GREEDY)
        good.turn(env_tokens(rng, 8))
        sid = uuid.uuid4().hex
        assert refusal(raw_turn(stub, sid, [5, 6], n=2)) == (grpc.StatusCode.INVALID_ARGUMENT, Reason.BAD_SESSION)
        list(raw_turn(stub, sid, [5, 6, 7]))  # a session of 3 + 4 tokens
        over = raw_turn(stub, sid, [9] * 200, max_new_tokens=60, expect=7)  # 7 + 200 + 60 > the context of 256
        assert refusal(over) == (grpc.StatusCode.INVALID_ARGUMENT, Reason.CONTEXT_TOO_LONG)
        assert refusal(raw_turn(stub, sid, [5], expect=3)) == (grpc.StatusCode.FAILED_PRECONDITION, Reason.SESSION_LOST)
        running = raw_turn(stub, sid, [8], max_new_tokens=100, expect=7)
        next(running)  # the turn has started: a second one of the same session is refused
        assert refusal(raw_turn(stub, sid, [8], expect=7)) == (grpc.StatusCode.FAILED_PRECONDITION, Reason.SESSION_BUSY)
        running.cancel()
        text_later = pb.GenerateRequest(n=1, text="more", sampling=pb.SamplingParams(max_new_tokens=2))
        text_later.session.id = good.id  # the proxy does not tokenize a later turn
        assert refusal(stub.Generate(text_later, timeout=30)) == (grpc.StatusCode.INVALID_ARGUMENT, Reason.BAD_SESSION)
        before = good.history
        reply = good.turn(env_tokens(rng))
        assert good.history[: len(before)] == before and good.history[-len(reply.token_ids) :] == reply.token_ids


def test_a_session_flood_is_refused_and_sessions_in_use_are_kept(replicas, workdir):
    small = start_proxy(
        workdir, "flooded", replicas, "--set", "sessions.max_sessions=4", "--set", "sessions.min_idle_s=600"
    )
    try:
        wait_routable(small, replicas)
        rng = random.Random(5)
        with Client(small.target) as client:
            kept = client.session(**GREEDY)
            kept.turn(env_tokens(rng, 8))
            for _ in range(3):
                client.session(**GREEDY).turn(env_tokens(rng))
            with pytest.raises(ResourceExhausted) as full:
                client.session(**GREEDY).turn(env_tokens(rng))
            assert full.value.reason == Reason.SESSIONS_FULL and full.value.retry_after_s
            before = kept.history
            kept.turn(env_tokens(rng))
            assert kept.history[: len(before)] == before
        text = small.metrics()
        assert metric_value(text, "rollwire_proxy_sessions_active") == 4
        assert metric_value(text, 'rollwire_proxy_session_turns_total{outcome="refused"}') >= 1
        assert metric_value(text, 'rollwire_proxy_session_evictions_total{cause="lru"}') == 0
    finally:
        stop_all([small])


def test_an_extending_prompt_goes_where_its_prefix_was_served(proxy):
    rng = random.Random(6)
    before = proxy.metrics()
    with Client(proxy.target) as client:
        prompt = env_tokens(rng, 40)
        first = client.generate(prompt, **GREEDY)
        served = {first.replica}
        history = prompt + first.samples[0].token_ids
        for _ in range(3):  # a caller resending its whole conversation every turn, no session
            history += env_tokens(rng)
            result = client.generate(history, **GREEDY)
            served.add(result.replica)
            history += result.samples[0].token_ids
    after = proxy.metrics()
    assert served == {first.replica}
    hits = 'rollwire_proxy_prefix_routes_total{outcome="hit"}'
    assert metric_value(after, hits) - metric_value(before, hits) >= 3


def test_the_http_door_routes_an_extending_prompt_by_its_prefix_too(proxy, replicas, tiny_model):
    ok = 'rollwire_generator_requests_total{code="OK"}'
    before = [metric_value(r.metrics(), ok) for r in replicas]
    rng = random.Random(9)
    history = env_tokens(rng, 40)
    for _ in range(4):  # an OpenAI-style harness: the whole conversation every turn, no session
        body = {
            "model": str(tiny_model),
            "prompt": history,
            "max_tokens": 4,
            "temperature": 0,
            "return_token_ids": True,
        }
        reply = requests.post(proxy.http_url + "/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        history = history + reply.json()["choices"][0]["token_ids"] + env_tokens(rng)
    served = sorted(metric_value(r.metrics(), ok) - b for r, b in zip(replicas, before, strict=True))
    assert served == [0, 4]


def test_a_pinned_session_keeps_its_version_and_a_following_one_moves_on(proxy, tiny_model):
    fp, rng = fingerprint(proxy.target), random.Random(8)

    def publish(version: int) -> None:
        adapter = make_adapter(tiny_model, seed=40 + version)
        push(proxy.target, adapter.manifest("sess", version, fp), adapter.payload)

    with Client(proxy.target) as client:
        publish(1)
        pinned = client.session(adapter="sess", **GREEDY)
        follows = client.session(adapter="sess", follow=True, **GREEDY)
        assert pinned.turn(env_tokens(rng, 8)).adapter_version == 1
        assert follows.turn(env_tokens(rng, 8)).adapter_version == 1
        publish(2)
        assert set(pinned.turn(env_tokens(rng)).token_versions) == {1}  # the episode stays on one policy
        assert set(follows.turn(env_tokens(rng)).token_versions) == {2}  # each turn resolves the newest
        with pytest.raises(InvalidArgument) as other:  # a session keeps its adapter
            client._generate_request(_turn_request(pinned, env_tokens(rng), adapter=None), None)
        assert other.value.reason == Reason.BAD_SESSION


def _turn_request(session, new: list[int], **options):
    request = build_generate_request(new, 1, **{**GREEDY, **options})
    request.session.id, request.session.expect_tokens = session.id, len(session.history)
    return request


def test_an_episode_survives_its_replica_being_killed(tiny_model, workdir, reference_model):
    pair = start_generators(tiny_model, workdir, ["k1", "k2"])
    front = start_proxy(workdir, "kproxy", pair)
    try:
        wait_routable(front, pair)
        rng = random.Random(7)
        with Client(front.target) as client:
            session = client.session(**GREEDY)
            replies = [session.turn(env_tokens(rng, 8)), session.turn(env_tokens(rng))]
            victim = next(s for s in pair if s.name == replies[-1].replica)
            victim.kill()
            victim.proc.wait(timeout=10)
            replies += [session.turn(env_tokens(rng)), session.turn(env_tokens(rng))]
        assert {r.replica for r in replies[2:]} == {s.name for s in pair if s is not victim}
        greedy, _ = teacher_forced(reference_model, session.history, session.loss_mask)
        assert greedy == [t for r in replies for t in r.token_ids]
        moved = sum(
            metric_value(front.metrics(), f'rollwire_proxy_session_routes_total{{outcome="{o}"}}')
            for o in ("down", "failed")
        )
        assert moved == 1
    finally:
        stop_all([front, *pair])


# -- the store and the prefix index alone (a clock the test moves) -------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def store(clock: Clock, **limits):
    from rollwire.proxy.metrics import ProxyMetrics
    from rollwire.serving.sessions import SessionSection, SessionStore

    return SessionStore(SessionSection(**limits), ProxyMetrics("least-loaded").sessions, clock=clock)


def completed(st, caller: str, sid: str, new: list[int], reply: list[int], **kw):
    turn = st.begin(caller, sid, len(new), len(reply), 256, **kw)
    turn.commit([*turn.history, *new], reply)
    turn.close()
    return turn.session


def test_the_store_keeps_exact_histories_and_a_failed_turn_changes_nothing():
    clock = Clock()
    st = store(clock)
    session = completed(st, "a", "s", [1, 2], [3])
    assert session.tokens == [1, 2, 3] and st.tokens == 3
    turn = st.begin("a", "s", 2, 5, 256)
    assert st.tokens == 3 + 7  # the running turn's reservation counts
    turn.close()  # failed: nothing appended, reservation released
    assert session.tokens == [1, 2, 3] and st.tokens == 3
    first = st.begin("a", "fresh", 2, 2, 256)
    first.close()  # a first turn that failed leaves no session behind
    assert st.get("a", "fresh") is None and len(st) == 1
    assert st.get("b", "s") is None  # ids are scoped by caller


def test_the_store_expires_by_ttl_and_evicts_only_idle_sessions_lru_first():
    from rollwire.common.errors import ResourceExhausted

    clock = Clock()
    st = store(clock, max_sessions=2, ttl_s=100, min_idle_s=10)
    completed(st, "a", "old", [1], [2])
    clock.now += 5
    completed(st, "a", "new", [1], [2])
    with pytest.raises(ResourceExhausted) as full:  # nobody idle 10 s: refused, nothing evicted
        st.begin("a", "third", 1, 1, 256)
    assert full.value.reason == Reason.SESSIONS_FULL and len(st) == 2
    clock.now += 6  # "old" idle 11 s, "new" 6 s: the least recently used idle one goes
    st.begin("a", "third", 1, 1, 256).close()
    assert st.get("a", "old") is None and st.get("a", "new") is not None
    clock.now += 101
    st.begin("a", "later", 1, 1, 256).close()
    assert st.get("a", "new") is None  # expired
    assert st.tokens == 0


def test_the_store_bounds_tokens_and_sessions_per_caller():
    from rollwire.common.errors import InvalidArgument, ResourceExhausted

    clock = Clock()
    st = store(clock, max_total_tokens=20, max_sessions_per_client=2, min_idle_s=1000)
    completed(st, "a", "s1", [1] * 8, [2] * 2)
    with pytest.raises(ResourceExhausted):  # 10 held + 12 more would pass 20
        st.begin("a", "s1", 8, 4, 256)
    completed(st, "a", "s2", [1], [2])
    with pytest.raises(ResourceExhausted):
        st.begin("a", "s3", 1, 1, 256)
    st.begin("b", "s3", 1, 1, 256).close()  # another caller is not held to a's share
    with pytest.raises(InvalidArgument) as long:
        st.begin("a", "s1", 200, 50, 256)
    assert long.value.reason == Reason.CONTEXT_TOO_LONG


def test_the_prefix_index_is_bounded_and_routes_the_longest_known_prefix():
    from rollwire.proxy.policies import Candidate, PrefixAware

    policy = PrefixAware(block=4, max_entries=6)
    a, b = Candidate("a:1"), Candidate("b:1", in_flight=1)
    first = list(range(12))  # 3 blocks, goes to the least loaded: a
    assert policy.choose([a, b], policy.key_for("", None, first)).address == "a:1"
    b_free = Candidate("b:1")
    other = [50, 51, 52, 53]
    assert policy.choose([Candidate("a:1", in_flight=1), b_free], policy.key_for("", None, other)).address == "b:1"
    assert policy.outcome == "miss"
    longer = [*first, 99, 98, 97, 96]
    chosen = policy.choose([Candidate("a:1", in_flight=2), b_free], policy.key_for("", None, longer))
    assert chosen.address == "a:1" and policy.outcome == "hit"  # within the load bound's gap
    assert len(policy.index) <= 6
    busy = policy.choose([Candidate("a:1", in_flight=9), b_free], policy.key_for("", None, longer))
    assert busy.address == "b:1" and policy.outcome == "overloaded"
