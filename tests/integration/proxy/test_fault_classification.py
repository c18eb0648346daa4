"""Client faults are never replica faults (issue 11, build item 2).

The proxy's one classification (server/rollwire/proxy/routing/faults.py) decides, for each
status a replica sends, whether to retry the group elsewhere and whether to count it
towards the replica's ejection. Proven three ways:
- property-based, over `classify`: a status counts only when it means the replica is sick;
- property-based, over whole groups run by the real GroupRun against scripted replicas: a
  failure that follows the request (every replica answers it the same way) is never counted,
  and reaches the client unchanged;
- end to end: a proxy over two real tiny-model replicas, hammered with hostile requests
  beside well-behaved clients, ejects nothing and keeps both replicas routable.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollwire.common.errors import RollwireError, from_rpc_error, to_status
from rollwire.common.reasons import Reason
from rollwire.proxy.config import RoutingSection
from rollwire.proxy.fleet.breaker import Breaker
from rollwire.proxy.metrics import ProxyMetrics
from rollwire.proxy.routing import faults
from rollwire.proxy.routing.failover import GroupRun
from rollwire.proxy.routing.passthrough import PassThrough
from rollwire.v1 import generator_pb2 as pb
from rollwire.v1 import generator_pb2_grpc

C = grpc.StatusCode
CODES = [c for c in C if c != C.OK]
KNOWN_REASONS = ["", "INTERNAL", "UNKNOWN", *Reason, "BAD_REQUEST_ID", "SHUTTING_DOWN"]
"""No reason, the code's name (what a status without one carries), every reason, and two no service sends."""
reasons = st.one_of(st.sampled_from(KNOWN_REASONS), st.text(max_size=20))
flags = st.booleans()


def sick(code: grpc.StatusCode, reason: str, deadline_passed: bool) -> bool:
    """The statuses that mean the replica itself is sick, spelled out independently."""
    return (
        code == C.UNAVAILABLE
        or (code == C.DEADLINE_EXCEEDED and not deadline_passed)
        or (code in (C.INTERNAL, C.UNKNOWN) and reason == Reason.ENGINE_FAILED)
    )


# -- the classification function -------------------------------------------------------------
@settings(max_examples=2000, deadline=None)
@given(st.sampled_from(CODES), reasons, flags, flags, flags)
def test_a_status_counts_against_a_replica_only_when_it_means_the_replica_is_sick(
    code, reason, passed, pinned, suspected
):
    verdict = faults.classify(
        code, reason, group_deadline_passed=passed, version_pinned=pinned, suspected_before=suspected
    )
    assert verdict.counts == sick(code, reason, passed), (code, reason, verdict)
    if verdict.counts:
        assert verdict.retry


@settings(max_examples=1000, deadline=None)
@given(st.sampled_from(sorted(faults.CLIENT, key=str)), reasons, flags, flags)
def test_client_causable_statuses_are_never_counted(code, reason, passed, suspected):
    verdict = faults.classify(
        code, reason, group_deadline_passed=passed, version_pinned=False, suspected_before=suspected
    )
    assert not verdict.counts
    busy = code == C.RESOURCE_EXHAUSTED and reason in (Reason.QUEUE_FULL, Reason.ENGINE_OOM, Reason.TENANT_SLOTS_FULL)
    assert (
        verdict.retry == busy
    )  # busy (its queue, its memory, its tenant's slots for this group): elsewhere, uncounted


@settings(max_examples=500, deadline=None)
@given(
    st.sampled_from([C.INTERNAL, C.UNKNOWN]),
    reasons.filter(lambda r: r not in ("", "INTERNAL", "UNKNOWN", Reason.ENGINE_FAILED)),
)
def test_a_named_per_request_failure_is_relayed_and_never_counted(code, reason):
    verdict = faults.classify(code, reason)
    assert verdict == faults.CLIENT_FAULT


def test_the_table():
    cases = {
        (C.UNAVAILABLE, ""): (True, True),
        (C.DEADLINE_EXCEEDED, ""): (True, True),
        (C.INTERNAL, Reason.ENGINE_FAILED): (True, True),
        (C.INTERNAL, Reason.ROW_FAILED): (False, False),
        (C.FAILED_PRECONDITION, Reason.NON_FINITE_LOGITS): (False, False),
        (C.INTERNAL, ""): (True, False),  # suspect: once elsewhere, counted only if it then succeeds
        (C.UNKNOWN, "UNKNOWN"): (True, False),
        (C.DATA_LOSS, ""): (True, False),
        (C.CANCELLED, ""): (True, False),
        (C.RESOURCE_EXHAUSTED, Reason.QUEUE_FULL): (True, False),
        (C.RESOURCE_EXHAUSTED, Reason.ENGINE_OOM): (True, False),  # out of memory for this group: the load, not a fault
        (C.RESOURCE_EXHAUSTED, Reason.PROMPT_TOO_LONG): (False, False),
        (C.INVALID_ARGUMENT, Reason.BAD_TEMPERATURE): (False, False),
        (C.NOT_FOUND, Reason.ADAPTER_NOT_FOUND): (False, False),
    }
    for (code, reason), want in cases.items():
        verdict = faults.classify(code, reason)
        assert (verdict.retry, verdict.counts) == want, (code, reason)
    assert faults.classify(C.INTERNAL, "", suspected_before=True) == faults.CLIENT_FAULT
    assert faults.classify(C.DEADLINE_EXCEEDED, "", group_deadline_passed=True) == faults.DEADLINE
    assert faults.classify(C.NOT_FOUND, Reason.ADAPTER_VERSION_NOT_FOUND, version_pinned=True) == faults.STALE


# -- whole groups through the real GroupRun, against scripted replicas -----------------------
def rpc_error(code: grpc.StatusCode, reason: str) -> grpc.aio.AioRpcError:
    status = to_status(RollwireError("scripted", reason=reason, code=code)) if reason else None
    trailers = grpc.aio.Metadata(*status.trailing_metadata) if status else grpc.aio.Metadata()
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailers, "scripted")


class FakeCall:
    def __init__(self, messages, error):
        self.messages, self.error = messages, error

    def __aiter__(self):
        return self._run()

    async def _run(self):
        for m in self.messages:
            yield m
        if self.error is not None:
            raise self.error

    def cancel(self):
        pass


class FakeReplica:
    """Answers every attempt with `outcome(request)`: (messages shown first, error or None)."""

    def __init__(self, address, outcome):
        self.address, self.outcome, self.metadata, self.attempts = address, outcome, (), set()
        self.breaker = Breaker(threshold=1, base_s=30, max_s=30)  # one counted failure ejects
        self.failures = 0
        replica = self

        class Generator:
            def Generate(self, request, timeout, metadata):
                messages, error = replica.outcome(request)
                return FakeCall(messages, error)

        self.generator = Generator()


class FakeReplicas:
    def __init__(self, members):
        self.members = members

    def routable(self):
        return [r for r in self.members if r.breaker.allows(time.monotonic())]

    def latest(self, name):
        return 0


class FakeLease:
    def __init__(self, replica):
        self.replica = replica

    def release(self):
        pass


class FakeDispatcher:
    def __init__(self, replicas, routing, metrics):
        self.replicas, self.routing, self.metrics = replicas, routing, metrics

    async def acquire(self, need, key, work, exclude, deadline, client=None, first=True, prefer=""):
        members = self.replicas.members
        return FakeLease(next((r for r in members if r.address not in exclude), members[0]))

    async def wait_for_replica(self, deadline):
        pass

    def wake(self):
        pass

    def key_for(self, request):
        return b""


def started(replica):
    return pb.GenerateResponse(started=pb.GenerationStarted(replica=replica))


def tokens():
    return pb.GenerateResponse(tokens=[pb.TokenChunk(sample_index=0, token_ids=[5], logprobs=[-0.1])])


def finished():
    return pb.GenerateResponse(finished=[pb.SampleFinished(sample_index=0, completion_tokens=1)])


async def run_group(replicas, max_attempts=3):
    """(messages, final error or None, metrics) of one group run by GroupRun."""
    fakes = FakeReplicas(replicas)
    metrics = ProxyMetrics("least-loaded")
    run = GroupRun(
        pb.GenerateRequest(text="x", n=1, sampling=pb.SamplingParams(max_new_tokens=1)),
        "rid",
        time.monotonic() + 30,
        FakeDispatcher(fakes, RoutingSection(max_attempts=max_attempts), metrics),
    )
    got, error = [], None
    try:
        async for message in run.events():
            got.append(message)
    except (PassThrough, RollwireError) as exc:
        error = exc
    return got, error, metrics


def ejections(metrics) -> float:
    return sum(
        s.value
        for f in metrics.registry.collect()
        if f.name == "rollwire_proxy_ejections"
        for s in f.samples
        if s.name.endswith("_total")
    )


REQUEST_CAUSED = st.tuples(
    st.sampled_from([c for c in CODES if c not in (C.UNAVAILABLE, C.DEADLINE_EXCEEDED)]),
    reasons.filter(lambda r: r != Reason.ENGINE_FAILED),
    st.booleans(),  # the replica showed tokens before failing
)


@settings(max_examples=300, deadline=None)
@given(REQUEST_CAUSED, st.integers(1, 3), st.integers(1, 3))
def test_a_failure_that_follows_the_request_is_never_counted(failure, replica_count, max_attempts):
    """Whatever a request makes a replica answer, if every replica answers it the same way
    (the fault follows the request), no replica's breaker hears of it."""
    code, reason, visible = failure

    def outcome(request):
        return ([started("r"), tokens()] if visible else [started("r")]), rpc_error(code, reason)

    replicas = [FakeReplica(f"r{i}", outcome) for i in range(replica_count)]
    _, error, metrics = asyncio.run(run_group(replicas, max_attempts))
    assert error is not None
    assert all(r.breaker.failures == 0 and r.breaker.ejections == 0 for r in replicas)
    assert ejections(metrics) == 0
    if isinstance(error, PassThrough):
        assert error.code == code  # relayed unchanged


def test_an_unexplained_internal_counts_only_when_the_same_request_succeeds_elsewhere():
    bad = FakeReplica("bad", lambda req: ([started("bad")], rpc_error(C.INTERNAL, "")))
    good = FakeReplica("good", lambda req: ([started("good"), tokens(), finished()], None))
    got, error, metrics = asyncio.run(run_group([bad, good]))
    assert error is None and got[0].started.replica == "good"
    assert bad.breaker.ejections == 1 and good.breaker.ejections == 0 and ejections(metrics) == 1


def test_an_unexplained_internal_on_two_replicas_is_the_requests_and_is_relayed():
    first = FakeReplica("a", lambda req: ([started("a")], rpc_error(C.INTERNAL, "")))
    second = FakeReplica("b", lambda req: ([started("b")], rpc_error(C.UNKNOWN, "")))
    third = FakeReplica("c", lambda req: ([started("c"), tokens(), finished()], None))
    _, error, _metrics = asyncio.run(run_group([first, second, third]))
    assert isinstance(error, PassThrough) and error.code == C.UNKNOWN  # retried once, not twice
    assert [r.breaker.ejections for r in (first, second, third)] == [0, 0, 0]


def test_sick_replicas_still_count():
    for code, reason in [(C.UNAVAILABLE, ""), (C.INTERNAL, Reason.ENGINE_FAILED), (C.DEADLINE_EXCEEDED, "")]:
        bad = FakeReplica("bad", lambda req, c=code, r=reason: ([started("bad")], rpc_error(c, r)))
        good = FakeReplica("good", lambda req: ([started("good"), tokens(), finished()], None))
        _, error, _ = asyncio.run(run_group([bad, good]))
        assert error is None and bad.breaker.ejections == 1, code


def test_a_per_request_failure_is_relayed_at_once():
    calls = []

    def outcome(request):
        calls.append(1)
        return [started("a")], rpc_error(C.INTERNAL, Reason.ROW_FAILED)

    replicas = [FakeReplica("a", outcome), FakeReplica("b", outcome)]
    _, error, _ = asyncio.run(run_group(replicas))
    assert (
        isinstance(error, PassThrough)
        and from_rpc_error(rpc_error(C.INTERNAL, Reason.ROW_FAILED)).reason == Reason.ROW_FAILED
    )
    assert len(calls) == 1 and all(r.breaker.failures == 0 for r in replicas)


# -- end to end: two real replicas, hostile requests beside well-behaved clients ---------------
def hostile_requests() -> dict[str, pb.GenerateRequest]:
    def req(text="1+1=", n=2, adapter="", version=0, **sampling):
        sampling.setdefault("max_new_tokens", 4)
        r = pb.GenerateRequest(text=text, n=n, sampling=pb.SamplingParams(**sampling))
        if adapter:
            r.adapter.name, r.adapter.version = adapter, version
        return r

    cases = {
        "denormal temperature": req(temperature=1e-45),
        "tiny temperature": req(temperature=1e-30),
        "nan temperature": req(temperature=math.nan),
        "inf temperature": req(temperature=math.inf),
        "negative temperature": req(temperature=-3.0),
        "nan top_p": req(top_p=math.nan),
        "huge top_k": req(top_k=2**32 - 1),
        "huge n": req(n=2**31),
        "huge max_new_tokens": req(max_new_tokens=2**31),
        "unknown adapter": req(adapter="no-such-adapter"),
        "unknown adapter version": req(adapter="no-such-adapter", version=2**63),
        "adapter name with newline": req(adapter="a\nb"),
        "oversized prompt": req(text="7" * 200_000),
        "absurd stop strings": req(stop=["\x00" * 5000] * 50),
        "huge seed": req(seed=2**64 - 1),
    }
    ids = pb.GenerateRequest(n=1, sampling=pb.SamplingParams(max_new_tokens=2))
    ids.token_ids.ids.extend([-1, 2**31 - 1])
    cases["bad token ids"] = ids
    for name, rid in {
        "request id with newline": "a\nb\r\n",
        "request id with control chars": "\x00\x1b[31m\x7f",
        "huge request id": "r" * 100_000,
    }.items():
        r = req()
        r.request_id = rid
        cases[name] = r
    return cases


CLIENT_CODES = {C.INVALID_ARGUMENT, C.NOT_FOUND, C.FAILED_PRECONDITION, C.OUT_OF_RANGE, C.RESOURCE_EXHAUSTED}


@pytest.fixture(scope="module")
def fleet(tiny_model, fleets, tmp_path_factory):
    """A proxy of this module's own (ejecting after one failure) over the session's shared two
    replicas (support.fleets): the tests only send requests, so the replicas are only read."""
    from support.processes import start_proxy, stop_all, wait_routable

    workdir = tmp_path_factory.mktemp("faults")
    replicas = fleets.replicas(tiny_model, 2)
    proxy = start_proxy(workdir, "faults-proxy", replicas, "--set", "health.eject_after_failures=1")
    wait_routable(proxy, replicas)
    yield proxy, replicas
    stop_all([proxy])


def test_no_hostile_request_ejects_a_replica_or_disturbs_other_clients(fleet):
    from support.wire import metric_value, request, run_group, status

    proxy, _replicas = fleet
    stop, lock = threading.Event(), threading.Lock()
    done, failures = [0], []

    def well_behaved(index):
        with grpc.insecure_channel(proxy.target) as channel:
            stub = generator_pb2_grpc.GeneratorServiceStub(channel)
            seed = 0
            while not stop.is_set() or seed < 3:  # at least 3 each, the rest while the hostile ones run
                seed += 1
                try:
                    run_group(stub, request(f"{index}+{seed}=", n=2, max_new_tokens=4, seed=seed), timeout=30)
                    with lock:
                        done[0] += 1
                except Exception as exc:
                    with lock:
                        failures.append(repr(exc)[:300])

    cases = hostile_requests()
    outcomes = {}

    def hostile(name):
        with grpc.insecure_channel(proxy.target, options=[("grpc.max_send_message_length", 8 << 20)]) as channel:
            stub = generator_pb2_grpc.GeneratorServiceStub(channel)
            for _ in range(3):  # again and again: an ejection needs only consecutive failures
                try:
                    list(stub.Generate(cases[name], timeout=20))
                    outcomes.setdefault(name, []).append((C.OK, ""))
                except grpc.RpcError as exc:
                    outcomes.setdefault(name, []).append((exc.code(), from_rpc_error(exc).reason))

    background = [threading.Thread(target=well_behaved, args=(i,), daemon=True) for i in range(3)]
    for t in background:
        t.start()
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(hostile, sorted(cases)))
    stop.set()
    for t in background:
        t.join(60)

    for name, got in outcomes.items():
        for code, reason in got:
            assert code in CLIENT_CODES | {C.OK}, (name, code, reason)
            assert code == C.OK or reason, (name, code)
    assert failures == [], f"{len(failures)} well-behaved requests failed beside the hostile ones: {failures[:3]}"
    assert done[0] >= 9
    metrics = proxy.metrics()
    ejected = [
        line
        for line in metrics.splitlines()
        if line.startswith("rollwire_proxy_ejections_total{") and float(line.split()[-1]) > 0
    ]
    assert ejected == []
    st_ = status(proxy.target)
    assert len(st_.replicas) == 2 and all(r.healthy for r in st_.replicas), st_.replicas
    refused = sum(1 for got in outcomes.values() for code, _ in got if code != C.OK)
    counted = sum(metric_value(metrics, "rollwire_proxy_client_errors_total", f'code="{c.name}"') for c in CLIENT_CODES)
    assert refused > 0 and counted == refused  # every relayed refusal is counted as the client's


pytestmark = pytest.mark.integration  # starts processes or servers: not in make test-fast
