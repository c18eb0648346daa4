"""The hostile-input suite: whatever one client sends, the others do not notice.

A proxy over two real tiny-model replicas serves a background load of well-behaved clients
for the whole module. Beside them a hostile client sends adversarial and random requests,
pushes and metadata. The suite asserts the blast-radius contract (issue 11):
- every well-behaved request completes (counted, not sampled);
- each hostile request is refused with a client-fault status (never INTERNAL/UNKNOWN),
  within 1 s, while a small request sent at the same moment completes within 2 s;
- no replica is ejected and both stay routable (the proxy's own metrics and status say so);
- bystanders in a process of their own (support/bystanders.py: groups and GetStatus polls)
  call beside the whole hostile run and their p99 latency stays within 2x of theirs beside the
  same background load without the hostile client, measured before and after it (issue 32);
  a run over that bound with every call answered is measured once more, beside a replay of the
  hostile Generate cases (support.bystanders.measured_twice).
"""

from __future__ import annotations

import math
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.bystanders import Bystanders, Record, calm_run, measured_twice
from support.learner import log_events
from support.processes import routable, start_proxy, stop_all, wait_routable, wait_until
from support.wire import fingerprint, make_adapter, push_messages, request, run_group

from rollwire.common.errors import from_rpc_error
from rollwire.v1 import generator_pb2 as pb
from rollwire.v1 import generator_pb2_grpc

CLIENT_FAULTS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.OUT_OF_RANGE,
}
REFUSE_WITHIN_S = 1.0
PROBE_WITHIN_S = 2.0
CALM_S = 4.0


# -- the fleet and its well-behaved clients ------------------------------------------------
@pytest.fixture(scope="module")
def fleet(tiny_model, fleets, tmp_path_factory):
    """A proxy of this module's own over the session's shared two replicas (support.fleets):
    hostile calls only send requests, so the replicas are only read."""
    workdir = tmp_path_factory.mktemp("hostile")
    replicas = fleets.replicas(tiny_model, 2)
    proxy = start_proxy(workdir, "hostile-proxy", replicas)
    wait_routable(proxy, replicas)
    yield proxy, replicas
    stop_all([proxy])


@dataclass
class Background:
    """Well-behaved clients sampling small groups in a loop until told to stop."""

    target: str
    clients: int = 3
    done: int = 0
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self, index: int) -> None:
        with grpc.insecure_channel(self.target) as channel:
            stub = generator_pb2_grpc.GeneratorServiceStub(channel)
            seed = 0
            while not self.stop.is_set():
                seed += 1
                try:
                    run_group(stub, request(f"{index}+{seed % 90}=", n=2, max_new_tokens=4, seed=seed), timeout=30)
                    with self.lock:
                        self.done += 1
                except Exception as exc:  # every failure is a finding; keep counting
                    with self.lock:
                        self.failures.append(f"client {index}: {exc!r}"[:300])


@pytest.fixture(scope="module")
def background(fleet):
    proxy, _ = fleet
    load = Background(proxy.target)
    threads = [threading.Thread(target=load.run, args=(i,), daemon=True) for i in range(load.clients)]
    for t in threads:
        t.start()
    yield load
    load.stop.set()
    for t in threads:
        t.join(60)


@pytest.fixture(scope="module", autouse=True)
def bystanders(fleet, background, tmp_path_factory):
    """Calm first (the background alone, CALM_S), then the same bystanders for the rest of the
    module, from before its first hostile call, then calm again (in the verdict): the verdict
    compares the hostile run with both calm runs around it."""
    proxy, _ = fleet
    work = tmp_path_factory.mktemp("bystanders")
    calm = calm_run(proxy, work / "calm.json", CALM_S)
    with Bystanders(proxy, work / "during.json") as during:
        yield calm, during, work


@pytest.fixture(scope="module")
def stub(fleet):
    with grpc.insecure_channel(fleet[0].target) as channel:
        yield generator_pb2_grpc.GeneratorServiceStub(channel)


def outcome(call) -> tuple[grpc.StatusCode, str, float]:
    """(code, reason, seconds) of one call."""
    start = time.monotonic()
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code(), from_rpc_error(exc).reason, time.monotonic() - start
    return grpc.StatusCode.OK, "", time.monotonic() - start


def probe_seconds(stub) -> float:
    start = time.monotonic()
    run_group(stub, request("7+8=", n=1, max_new_tokens=2, ignore_eos=True), timeout=10)
    return time.monotonic() - start


def hostile_beside_probe(stub, call) -> tuple[grpc.StatusCode, str, float, float]:
    """Send a hostile call and, at the same moment, a small well-behaved request."""
    with ThreadPoolExecutor(2) as pool:
        hostile = pool.submit(outcome, call)
        time.sleep(0.02)  # let the hostile request reach the server first
        probe = pool.submit(probe_seconds, stub)
        code, reason, seconds = hostile.result(timeout=30)
        return code, reason, seconds, probe.result(timeout=30)


# -- hostile Generate requests, by case ----------------------------------------------------
def _req(**changes) -> pb.GenerateRequest:
    sampling = dict(max_new_tokens=4)
    sampling.update(changes.pop("sampling", {}))
    req = pb.GenerateRequest(text="1+1=", n=2, sampling=pb.SamplingParams(**sampling))
    for key, value in changes.items():
        if key == "token_ids":
            req.token_ids.ids.extend(value)
        elif key == "adapter":
            req.adapter.name, req.adapter.version = value
        else:
            setattr(req, key, value)
    return req


GENERATE_CASES = {
    "denormal temperature": _req(sampling={"temperature": 1e-45}),
    "tiny temperature": _req(sampling={"temperature": 1e-7}),
    "nan temperature": _req(sampling={"temperature": math.nan}),
    "inf temperature": _req(sampling={"temperature": math.inf}),
    "negative temperature": _req(sampling={"temperature": -1.0}),
    "huge temperature": _req(sampling={"temperature": 1e30}),
    "nan top_p": _req(sampling={"top_p": math.nan}),
    "zero top_p": _req(sampling={"top_p": 0.0}),
    "top_p above one": _req(sampling={"top_p": 1.5}),
    "zero n": _req(n=0),
    "huge n": _req(n=2**32 - 1),
    "zero max_new_tokens": _req(sampling={"max_new_tokens": 0}),
    "huge max_new_tokens": _req(sampling={"max_new_tokens": 2**32 - 1}),
    "7 MiB text prompt": _req(text="9" * (7 << 20)),
    "negative token ids": _req(token_ids=[-1, 5]),
    "token ids past the vocabulary": _req(token_ids=[2**31 - 1]),
    "a million token ids": _req(token_ids=[5] * 1_000_000),
    "empty prompt": _req(text=""),
    "request id with a newline": _req(request_id="abc\n"),
    "request id with control bytes": _req(request_id="\x00\x01\x7f"),
    "64 KiB request id": _req(request_id="x" * 65536),
    "unknown adapter": _req(adapter=("no-such-adapter", 0)),
    "adapter name with path": _req(adapter=("../../etc/passwd", 0)),
    "64 KiB adapter name": _req(adapter=("a" * 65536, 0)),
    "top-of-range adapter version": _req(adapter=("no-such-adapter", 2**64 - 1)),
    "a thousand stop strings": _req(sampling={"stop": ["x"] * 1000}),
    "64 KiB stop string": _req(sampling={"stop": ["y" * 65536]}),
    "empty stop string": _req(sampling={"stop": [""]}),
    "1 MiB group key": _req(group_key="k" * (1 << 20)),
}


@pytest.mark.parametrize("case", sorted(GENERATE_CASES))
def test_hostile_generate_is_refused_alone(fleet, background, stub, case):
    req = GENERATE_CASES[case]
    code, reason, seconds, probe = hostile_beside_probe(stub, lambda: list(stub.Generate(req, timeout=20)))
    assert code in CLIENT_FAULTS | {grpc.StatusCode.OK}, (case, code, reason)
    if code != grpc.StatusCode.OK:
        assert reason, f"{case}: refused with {code.name} but no ErrorInfo reason a program can act on"
        assert seconds < REFUSE_WITHIN_S, f"{case}: refused after {seconds:.2f}s"
    assert probe < PROBE_WITHIN_S, f"{case}: a small request beside it took {probe:.2f}s"


SIZE_CASES = {
    "7 MiB text prompt": "PROMPT_TOO_LONG",
    "a million token ids": "PROMPT_TOO_LONG",
    "1 MiB group key": "BAD_GROUP_KEY",
}


@pytest.mark.parametrize("case", sorted(SIZE_CASES))
def test_a_request_no_replica_would_take_for_its_size_is_refused_by_the_proxy_itself(fleet, stub, case):
    """Limits before work: the proxy applies the replicas' own size rules (serving.sizes), the
    prompt's at the largest limit among them, so such a request is never keyed, copied or sent
    on: its log shows its own refusal (`generate_failed` with the reason), and no replica's
    refusal of it passed through (`generate_refused_by_replica`)."""
    proxy, _ = fleet
    reason = SIZE_CASES[case]

    def events(event: str) -> list[dict]:
        return log_events(proxy.log_path.read_text(errors="replace"), event)

    def own() -> int:
        return sum(e.get("reason") == reason for e in events("generate_failed"))

    def passed() -> int:
        return sum(
            ("group_key" if reason == "BAD_GROUP_KEY" else "prompt") in e.get("error", "")
            for e in events("generate_refused_by_replica")
        )

    before = own(), passed()
    code, got, _ = outcome(lambda: list(stub.Generate(GENERATE_CASES[case], timeout=20)))
    assert (code, got) == (grpc.StatusCode.INVALID_ARGUMENT, reason)
    wait_until(lambda: own() == before[0] + 1, 10, "the proxy logged its own refusal")
    assert passed() == before[1]


# -- hostile metadata ----------------------------------------------------------------------
METADATA_CASES = {
    "request id with spaces": (("x-request-id", "a b c"),),
    "4 KiB request id": (("x-request-id", "r" * 4096),),
    "junk bearer token": (("authorization", "Bearer " + "z" * 2000),),
    "binary junk header": (("x-junk-bin", b"\x00\xff" * 2000),),
}


@pytest.mark.parametrize("case", sorted(METADATA_CASES))
def test_hostile_metadata_changes_nothing(fleet, background, stub, case):
    metadata = METADATA_CASES[case]
    result = run_group(stub, request("2+2=", n=2, max_new_tokens=3), timeout=10, metadata=metadata)
    assert result.request_id and len(result.request_id) <= 64 and result.request_id.isprintable()


# -- hostile pushes --------------------------------------------------------------------------
def _nan_payload(payload: bytes) -> bytes:
    """The same safetensors file with its first F32 value replaced by NaN."""
    (header_len,) = struct.unpack("<Q", payload[:8])
    start = 8 + header_len
    return payload[:start] + struct.pack("<f", math.nan) + payload[start + 4 :]


def _huge_dims_payload() -> bytes:
    header = b'{"t":{"dtype":"F32","shape":[' + b",".join([b"1"] * 100_000) + b'],"data_offsets":[0,4]}}'
    return struct.pack("<Q", len(header)) + header + b"\0\0\0\0"


@pytest.fixture(scope="module")
def adapter(tiny_model):
    return make_adapter(tiny_model, seed=11)


def _push_cases(adapter, fp: str) -> dict[str, tuple[pb.AdapterManifest, bytes]]:
    import hashlib

    def manifest(payload: bytes, **changes) -> pb.AdapterManifest:
        m = adapter.manifest("hostile", 1, fp)
        m.byte_length, m.sha256 = len(payload), hashlib.sha256(payload).hexdigest()
        for key, value in changes.items():
            if key == "lora_config":
                m.lora_config.CopyFrom(value)
            else:
                setattr(m, key, value)
        return m

    nan = _nan_payload(adapter.payload)
    huge = _huge_dims_payload()
    good = adapter.payload
    return {
        "NaN tensor": (manifest(nan), nan),
        "NaN lora_alpha": (
            manifest(
                good, lora_config=pb.LoraConfig(r=adapter.r, lora_alpha=math.nan, target_modules=list(adapter.targets))
            ),
            good,
        ),
        "header of 100k dims": (manifest(huge), huge),
        "wrong base model": (manifest(good, base_model_fingerprint="sha256:" + "0" * 64), good),
        "top-of-range version": (manifest(good, version=2**64 - 1), good),
        "digest that lies": (adapter.manifest("hostile", 1, fp, sha256="0" * 64), good),
    }


PUSH_CASE_NAMES = [
    "NaN tensor",
    "NaN lora_alpha",
    "header of 100k dims",
    "wrong base model",
    "top-of-range version",
    "digest that lies",
]


@pytest.mark.parametrize("case", PUSH_CASE_NAMES)
def test_hostile_push_is_refused_and_bricks_nothing(fleet, background, stub, adapter, case):
    proxy, replicas = fleet
    m, payload = _push_cases(adapter, fingerprint(proxy.target))[case]
    code, reason, seconds, probe = hostile_beside_probe(
        stub, lambda: stub.PushAdapter(push_messages(m, payload), timeout=20)
    )
    assert code in CLIENT_FAULTS, (case, code, reason)
    assert seconds < REFUSE_WITHIN_S, f"{case}: refused after {seconds:.2f}s"
    assert probe < PROBE_WITHIN_S, f"{case}: a small request beside it took {probe:.2f}s"
    assert set(routable(proxy)) == {r.target for r in replicas}, f"{case}: a replica left rotation"


def test_a_good_push_still_lands_after_the_hostile_ones(fleet, background, stub, adapter):
    proxy, _replicas = fleet
    reply = stub.PushAdapter(
        push_messages(adapter.manifest("hostile", 1, fingerprint(proxy.target)), adapter.payload), timeout=30
    )
    assert reply.version == 1 and all(r.code == "OK" for r in reply.replicas)
    result = run_group(stub, request("3+4=", n=2, max_new_tokens=3, adapter="hostile"), timeout=10)
    assert result.version == 1


# -- random requests -----------------------------------------------------------------------
RANDOM = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
floats = st.one_of(st.floats(width=64), st.sampled_from([0.0, 1e-45, 5e-324, -0.0, 1e308]))
random_requests = st.builds(
    pb.GenerateRequest,
    request_id=st.text(max_size=80),
    text=st.text(min_size=0, max_size=30),
    n=st.integers(0, 40),
    sampling=st.builds(
        pb.SamplingParams,
        max_new_tokens=st.integers(0, 12),
        temperature=floats,
        top_p=floats,
        top_k=st.integers(0, 2**32 - 1),
        stop=st.lists(st.text(max_size=80), max_size=6),
        seed=st.integers(0, 2**64 - 1),
        ignore_eos=st.booleans(),
    ),
    adapter=st.builds(
        pb.AdapterRef,
        name=st.sampled_from(["", "hostile", "nope"]) | st.text(max_size=8),
        version=st.integers(0, 2**64 - 1),
    ),
    group_key=st.text(max_size=40),
)


@RANDOM
@given(req=random_requests)
def test_random_requests_get_a_client_status_never_a_replica_fault(fleet, background, stub, req):
    code, reason, seconds = outcome(lambda: list(stub.Generate(req, timeout=20)))
    assert code in CLIENT_FAULTS | {grpc.StatusCode.OK}, (code, reason, req)
    if code != grpc.StatusCode.OK:
        assert seconds < REFUSE_WITHIN_S, (seconds, req)


# -- the verdict -----------------------------------------------------------------------------
def replayed_beside(bystanders: Bystanders, stub) -> Bystanders:
    """Every hostile Generate case, over and over, for the whole of a bystanders' run (CALM_S,
    then until it has its calls): the hostile load of this module again, for a second
    measurement. Returns the ended run."""
    done = threading.Event()

    def replay() -> None:
        while not done.is_set():
            for req in GENERATE_CASES.values():
                outcome(lambda: list(stub.Generate(req, timeout=20)))  # called at once

    replayer = threading.Thread(target=replay, daemon=True)
    with bystanders:
        replayer.start()
        time.sleep(CALM_S)  # a length of run, not a wait for an event
        bystanders.stop()  # with the replay still on
    done.set()
    replayer.join(60)
    return bystanders


def test_zz_no_replica_was_ejected_and_every_good_request_completed(fleet, background, bystanders, stub):
    """The verdict. The bystanders' p99 beside the whole hostile run is one measurement; one over
    the bound with every call answered is measured once more (support.bystanders.measured_twice),
    beside a replay of every hostile Generate case (the 7 MiB prompt and the million ids among
    them) with the background load still on, then calm again."""
    proxy, replicas = fleet
    metrics = proxy.metrics()
    ejections = [
        line
        for line in metrics.splitlines()
        if line.startswith("rollwire_proxy_ejections_total{") and float(line.split()[-1]) > 0
    ]
    assert not ejections, ejections
    assert set(routable(proxy)) == {r.target for r in replicas}
    calm, during, work = bystanders
    runs: list[Bystanders | None] = [during, None]  # the module's run, then (if needed) a replay

    def case() -> tuple[None, Record, Record]:
        run = runs.pop(0)
        if run is None:  # measured again: the hostile Generate cases replayed beside fresh bystanders
            run = replayed_beside(Bystanders(proxy, work / "during-again.json"), stub)
        record = run.stop()
        after = calm_run(proxy, work / f"calm-after-{len(runs)}.json", CALM_S)  # the background load still on
        print(f"\nbeside the hostile run: {record.summary()}; calm: {calm.summary()}; after: {after.summary()}")
        return None, record, after

    try:
        measured_twice(case, calm)
    finally:
        background.stop.set()
    assert background.done > 50, f"the background clients completed only {background.done} groups"
    assert not background.failures, background.failures[:5]


pytestmark = pytest.mark.integration  # starts processes or servers: not in make test-fast
