"""The routing proxy in front of three real generator replicas (tiny model, real sockets).

A client cannot tell the proxy from a replica: same statuses for bad requests, pushes that
reach every replica, status that shows each replica. Policies, drain, backpressure, DNS
discovery, self-registration and a Node.js client are checked against the same replicas.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from support.processes import (
    GENERATOR_ARGS,
    ROOT,
    rollwire_cmd,
    routable,
    start_generator,
    start_generators,
    start_proxy,
    stop_all,
    wait_routable,
    wait_until,
)
from support.wire import admin, fingerprint, make_adapter, metric_value, push, request, run_group, status

from rollwire.common.errors import from_rpc_error
from rollwire.common.reasons import Reason
from rollwire.v1 import admin_pb2 as apb
from rollwire.v1 import generator_pb2 as pb
from rollwire.v1 import generator_pb2_grpc


@pytest.fixture(scope="module")
def replicas(tiny_model, workdir):
    services = start_generators(tiny_model, workdir, ["r1", "r2", "r3"])
    yield services
    stop_all(services)


@pytest.fixture(scope="module")
def proxy(replicas, workdir):
    """Round robin, so a handful of requests is served by every replica."""
    svc = start_proxy(workdir, "proxy", replicas, "--policy", "round-robin")
    wait_routable(svc, replicas)
    yield svc
    stop_all([svc])


@pytest.fixture(scope="module")
def stub(proxy):
    with grpc.insecure_channel(proxy.target) as channel:
        yield generator_pb2_grpc.GeneratorServiceStub(channel)


def by_name(replicas):
    return {r.target: r for r in replicas}


def test_status_shows_every_replica_with_its_health_load_and_versions(proxy, replicas):
    st = status(proxy.target)
    assert st.role == "proxy" and st.replica == "proxy"
    assert st.model_fingerprint == fingerprint(replicas[0].target)
    assert (st.limits.max_n, st.limits.max_new_tokens) == (16, 128)
    assert {r.address: r.replica for r in st.replicas} == {
        g.target: n for g, n in zip(replicas, ["r1", "r2", "r3"], strict=True)
    }
    assert all(r.healthy and not r.draining and not r.detail for r in st.replicas)
    out = subprocess.run(rollwire_cmd("status", "--target", proxy.target), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for g in replicas:
        assert g.target in out.stdout
    metrics = proxy.metrics()
    for g in replicas:
        assert metric_value(metrics, "rollwire_proxy_replica_healthy", f'replica="{g.target}"') == 1


def test_a_push_reaches_every_replica_and_the_next_request_uses_it(proxy, replicas, stub, tiny_model):
    fp = fingerprint(proxy.target)
    for version, seed in ((1, 1), (2, 2)):
        adapter = make_adapter(tiny_model, seed=seed)
        reply = push(proxy.target, adapter.manifest("fanout", version, fp), adapter.payload)
        assert (reply.name, reply.version, reply.already_loaded) == ("fanout", version, False)
        assert sorted((r.replica, r.code) for r in reply.replicas) == [("r1", "OK"), ("r2", "OK"), ("r3", "OK")]
        for g in replicas:  # each replica confirms it on its own
            assert [list(a.versions) for a in status(g.target).adapters if a.name == "fanout"] == [
                list(range(1, version + 1))
            ]
        served = [run_group(stub, request(f"after push {version}", adapter="fanout")) for _ in range(6)]
        assert {r.replica for r in served} == {"r1", "r2", "r3"}
        assert {r.version for r in served} == {version}
    again = push(proxy.target, adapter.manifest("fanout", 2, fp), adapter.payload)
    assert again.already_loaded and all(r.code == "OK" for r in again.replicas)
    labels = f'adapter="fanout",replica="{replicas[0].target}"'
    assert metric_value(proxy.metrics(), "rollwire_proxy_replica_adapter_version", labels) == 2


BAD_REQUESTS = {
    "empty prompt": request("", n=1),
    "n above the limit": request("ok", n=17),
    "max_new_tokens above the limit": request("ok", max_new_tokens=129),
    "negative temperature": request("ok", temperature=-0.5),
    "top_p of 0": request("ok", top_p=0.0),
    "token id outside the vocabulary": pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[5, 100000]), n=1, sampling=pb.SamplingParams(max_new_tokens=4)
    ),
    "unknown adapter": request("ok", adapter="nobody"),
    "version never pushed": pb.GenerateRequest(
        text="ok", n=1, sampling=pb.SamplingParams(max_new_tokens=4), adapter=pb.AdapterRef(name="fanout", version=99)
    ),
}


def refusal(call):
    with pytest.raises(grpc.RpcError) as info:
        call()
    err = from_rpc_error(info.value)
    return err.code, err.message, err.reason, err.retry_after_s


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_a_bad_request_gets_the_status_a_replica_gives(proxy, replicas, stub, case):
    req = BAD_REQUESTS[case]
    direct = generator_pb2_grpc.GeneratorServiceStub(grpc.insecure_channel(replicas[0].target))
    expected = refusal(lambda: list(direct.Generate(req, timeout=30)))
    assert expected[0] in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
    assert refusal(lambda: list(stub.Generate(req, timeout=30))) == expected


def test_a_bad_push_gets_the_status_a_replica_gives(proxy, replicas, tiny_model):
    adapter = make_adapter(tiny_model, seed=5)
    fp = fingerprint(proxy.target)
    cases = {
        "wrong base model": adapter.manifest("badpush", 1, "sha256:" + "0" * 32),
        "digest mismatch": adapter.manifest("badpush", 1, fp, sha256="ab" * 32),
        "length mismatch": adapter.manifest("badpush", 1, fp, byte_length=len(adapter.payload) + 1),
        "bad name": adapter.manifest("bad/name", 1, fp),
    }
    for case, manifest in cases.items():
        expected = refusal(lambda m=manifest: push(replicas[0].target, m, adapter.payload))
        assert refusal(lambda m=manifest: push(proxy.target, m, adapter.payload)) == expected, case
    assert all(a.name != "badpush" for a in status(proxy.target).adapters)  # refused everywhere, nothing kept


def test_affinity_keeps_a_group_and_a_prompt_on_one_replica(replicas, workdir):
    px = start_proxy(workdir, "affinity", replicas, "--policy", "affinity")
    try:
        wait_routable(px, replicas)
        before = sum(metric_value(g.metrics(), "rollwire_generator_requests_total", 'code="OK"') for g in replicas)
        prompts = [f"prompt number {i}: " for i in range(48)]
        jobs = prompts * 4
        random.Random(0).shuffle(jobs)
        with grpc.insecure_channel(px.target) as channel, ThreadPoolExecutor(4) as pool:
            stub = generator_pb2_grpc.GeneratorServiceStub(channel)
            results = list(pool.map(lambda p: run_group(stub, request(p, n=4, max_new_tokens=6)), jobs))
        after = sum(metric_value(g.metrics(), "rollwire_generator_requests_total", 'code="OK"') for g in replicas)
    finally:
        stop_all([px])
    assert after - before == len(jobs)  # one replica request per group: a group is never split
    assert all(len(r.attempts_started) == 1 and len(r.tokens) == 4 for r in results)
    per_prompt = defaultdict(Counter)
    for prompt, result in zip(jobs, results, strict=True):
        per_prompt[prompt][result.replica] += 1
    same = sum(c.most_common(1)[0][1] for c in per_prompt.values()) / len(jobs)
    owners = Counter(c.most_common(1)[0][0] for c in per_prompt.values())
    print(f"affinity: {same:.1%} of repeated prompts on their usual replica; prompts per replica {dict(owners)}")
    assert same >= 0.9
    assert len(owners) == 3  # and the prompts are spread over every replica


def test_draining_a_replica_under_load_loses_nothing(proxy, replicas, stub):
    target = replicas[0]
    jobs = list(range(48))
    results, errors, lock = [], [], threading.Lock()
    some_done = threading.Event()

    def worker():
        while True:
            with lock:
                if not jobs:
                    return
                i = jobs.pop()
            try:
                result = run_group(stub, request(f"drain {i}", n=2, max_new_tokens=16, request_id=f"drain-{i}"))
            except grpc.RpcError as exc:
                errors.append(exc)
                continue
            with lock:
                results.append(result)
                if len(results) >= 8:
                    some_done.set()

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    assert some_done.wait(60)
    reply = admin(proxy.target).DrainGenerator(apb.DrainGeneratorRequest(address=target.target), timeout=60)
    drained_at = time.monotonic()
    for t in threads:
        t.join(120)
    assert errors == []
    assert sorted(r.request_id for r in results) == sorted(f"drain-{i}" for i in range(48))
    assert all(r.restarts == 0 for r in results)  # in-flight groups finished where they were
    assert reply.replica.draining and reply.replica.in_flight == 0 and not reply.replica.healthy
    assert any(r.replica == "r1" for r in results)
    assert not any(r.replica == "r1" for r in results if r.sent_at > drained_at)
    # back into rotation: deregister, register again (it is caught up first)
    a = admin(proxy.target)
    assert a.DeregisterGenerator(apb.DeregisterGeneratorRequest(address=target.target), timeout=10).restarted == 0
    assert a.RegisterGenerator(apb.RegisterGeneratorRequest(address=target.target), timeout=10).created
    wait_routable(proxy, replicas)
    with pytest.raises(grpc.RpcError) as info:
        a.DrainGenerator(apb.DrainGeneratorRequest(address="127.0.0.1:1"), timeout=10)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and "ListGenerators" in info.value.details()


def test_backpressure_refuses_beyond_the_queue_with_a_retry_hint(replicas, workdir):
    tight = ("--set", "routing.max_in_flight_per_replica=1", "--set", "routing.max_queue=1")
    px = start_proxy(workdir, "tight", replicas[:1], *tight)
    try:
        wait_routable(px, replicas[:1])
        barrier = threading.Barrier(6)
        with grpc.insecure_channel(px.target) as channel:
            stub = generator_pb2_grpc.GeneratorServiceStub(channel)

            def one(i):
                barrier.wait()
                try:
                    return run_group(stub, request(f"bp {i}", n=1, max_new_tokens=96, ignore_eos=True))
                except grpc.RpcError as exc:
                    return from_rpc_error(exc)

            with ThreadPoolExecutor(6) as pool:
                outcomes = list(pool.map(one, range(6)))
    finally:
        stop_all([px])
    refused = [o for o in outcomes if not hasattr(o, "tokens")]
    assert 6 - len(refused) >= 2  # one ran, one waited its turn
    assert refused and all(
        (e.code, e.reason, e.retry_after_s) == (grpc.StatusCode.RESOURCE_EXHAUSTED, Reason.PROXY_QUEUE_FULL, 1.0)
        for e in refused
    )
    assert "add replicas" in refused[0].message


def test_dns_discovery_finds_the_replicas(replicas, workdir):
    px = start_proxy(
        workdir, "dns", [], "--discover", f"dns:///localhost:{replicas[1].port}", "--set", "discover_interval_s=0.5"
    )
    try:
        wait_until(lambda: replicas[1].target in routable(px), 30, "DNS discovery finds the replica")
        with grpc.insecure_channel(px.target) as channel:
            result = run_group(generator_pb2_grpc.GeneratorServiceStub(channel), request("found by dns"))
    finally:
        stop_all([px])
    assert result.replica == "r2"


def test_a_generator_joins_by_itself_caught_up_and_leaves_by_draining(proxy, stub, tiny_model, workdir):
    adapter = make_adapter(tiny_model, seed=21)
    push(proxy.target, adapter.manifest("joiner", 1, fingerprint(proxy.target)), adapter.payload)
    joiner = start_generator(
        tiny_model,
        workdir,
        "r4",
        *GENERATOR_ARGS,
        "--replica-id",
        "r4",
        "--register",
        proxy.target,
        "--register-ttl",
        "6",
    )
    try:
        wait_until(lambda: joiner.target in routable(proxy), 30, "the self-registered replica is routable")
        assert [list(a.versions) for a in status(joiner.target).adapters if a.name == "joiner"] == [[1]]
        served = [run_group(stub, request("joined", adapter="joiner")) for _ in range(4)]
        assert "r4" in {r.replica for r in served} and {r.version for r in served} == {1}
    finally:
        joiner.stop()
    listed = admin(proxy.target).ListGenerators(apb.ListGeneratorsRequest(), timeout=10).replicas
    assert joiner.target not in {r.address for r in listed}  # it drained and deregistered before stopping
    log = [json.loads(line) for line in joiner.log_path.read_text().splitlines() if line.startswith("{")]
    events = [e["event"] for e in log]
    assert "registered_with_proxy" in events and "left_proxy" in events


def test_a_node_js_client_generated_from_the_protos_gets_tokens(proxy):
    node = shutil.which("node")
    if node is None:
        pytest.skip("Node.js is not installed")
    if not (ROOT / ".tools" / "node_modules" / "@grpc" / "grpc-js").is_dir():
        pytest.fail("@grpc/grpc-js is missing: run `npm ci --prefix .tools` (make lint does)")
    out = subprocess.run(
        [node, str(ROOT / "tests" / "node" / "generate.js"), proxy.target, "hello from node", "3", "6"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout)
    assert result["started"]["replica"] in {"r1", "r2", "r3"}
    assert sorted(result["samples"]) == ["0", "1", "2"]
    for sample in result["samples"].values():
        assert 1 <= len(sample["tokens"]) <= 6 and len(sample["logprobs"]) == len(sample["tokens"])
        assert sample["finish_reason"] in {"FINISH_REASON_EOS", "FINISH_REASON_LENGTH"}


pytestmark = pytest.mark.integration  # starts processes or servers: not in make test-fast
