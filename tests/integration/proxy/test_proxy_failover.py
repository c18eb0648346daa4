"""Failover through the proxy with real generator replicas that hang, leave, die and restart.

The proxy answers every accepted request exactly once, complete or with an error, within
its deadline: a failure before the first token is retried invisibly, one mid-stream is
resumed elsewhere (each sample goes on from its tokens, the client sees no `restarted`:
the SIGKILL case with its exactness checks is tests/integration/proxy/test_proxy_resume.py),
and a replica that comes back is caught up with the newest adapter before it serves.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import threading
import time
from collections import defaultdict

import grpc
import pytest
from support.processes import (
    GENERATOR_ARGS,
    routable,
    start_generator,
    start_generators,
    start_proxy,
    stop_all,
    wait_routable,
    wait_until,
)
from support.wire import GroupResult, admin, fingerprint, make_adapter, push, request, run_group, status

from rollwire.common.errors import from_rpc_error
from rollwire.common.reasons import Reason
from rollwire.v1 import admin_pb2 as apb
from rollwire.v1 import generator_pb2_grpc

FAST_HEALTH = ("--set", "health.timeout_s=0.5")


@pytest.fixture(scope="module")
def cluster(tiny_model, workdir):
    """Three replicas a, b, c behind a least-loaded proxy; `started` collects replacements."""
    replicas = start_generators(tiny_model, workdir, ["a", "b", "c"])
    proxy = start_proxy(workdir, "proxy", replicas, *FAST_HEALTH)
    wait_routable(proxy, replicas)
    started: list = []
    yield replicas, proxy, started
    stop_all([proxy, *replicas, *started])


def long_group(prompt: str):
    """Long enough (8 x 128 tokens) to still be running when the test interferes."""
    return request(prompt, n=8, max_new_tokens=128, ignore_eos=True, seed=3)


def when_started(action):
    """An on_event hook running `action(replica id)` once, when the first attempt shows."""
    fired = []

    def hook(msg):
        if msg.HasField("started") and not fired:
            fired.append(msg.started.replica)
            action(msg.started.replica)

    return hook, fired


def test_a_replica_that_hangs_mid_stream_is_cut_off_and_the_group_resumed(cluster):
    replicas, proxy, _ = cluster
    by_id = {"a": replicas[0], "b": replicas[1], "c": replicas[2]}
    hook, frozen = when_started(lambda rid: os.kill(by_id[rid].proc.pid, signal.SIGSTOP))
    with grpc.insecure_channel(proxy.target) as channel:
        whole = run_group(generator_pb2_grpc.GeneratorServiceStub(channel), long_group("hang"))
    try:
        with grpc.insecure_channel(proxy.target) as channel:
            result = run_group(generator_pb2_grpc.GeneratorServiceStub(channel), long_group("hang"), on_event=hook)
    finally:
        for rid in frozen:
            os.kill(by_id[rid].proc.pid, signal.SIGCONT)
    assert result.restarts == 0 and result.attempts_started == [frozen[0]]  # one `started`, no `restarted`
    assert result.seconds < 10 and result.tokens == whole.tokens  # every sample went on where it stopped
    wait_routable(proxy, replicas)  # it answers again, is checked and caught up, and returns


def test_deregistering_a_replica_resumes_its_groups_elsewhere(cluster):
    replicas, proxy, _ = cluster
    by_id = {"a": replicas[0], "b": replicas[1], "c": replicas[2]}
    replies = []
    deregister = lambda rid: replies.append(  # noqa: E731
        admin(proxy.target).DeregisterGenerator(apb.DeregisterGeneratorRequest(address=by_id[rid].target), timeout=10)
    )
    hook, removed = when_started(deregister)
    with grpc.insecure_channel(proxy.target) as channel:
        result = run_group(generator_pb2_grpc.GeneratorServiceStub(channel), long_group("leave"), on_event=hook)
    assert replies[0].restarted == 1  # moved elsewhere: resumed
    assert result.restarts == 0 and result.attempts_started == [removed[0]] and len(result.tokens) == 8
    admin(proxy.target).RegisterGenerator(apb.RegisterGeneratorRequest(address=by_id[removed[0]].target), timeout=10)
    wait_routable(proxy, replicas)


def test_after_its_last_attempt_a_group_ends_with_unavailable_and_a_sentence(cluster, workdir):
    replicas, _, _ = cluster
    px = start_proxy(workdir, "one-attempt", replicas, "--set", "routing.max_attempts=1")
    try:
        wait_routable(px, replicas)
        by_id = {"a": replicas[0], "b": replicas[1], "c": replicas[2]}
        hook, removed = when_started(
            lambda rid: admin(px.target).DeregisterGenerator(
                apb.DeregisterGeneratorRequest(address=by_id[rid].target), timeout=10
            )
        )
        with grpc.insecure_channel(px.target) as channel, pytest.raises(grpc.RpcError) as info:
            run_group(generator_pb2_grpc.GeneratorServiceStub(channel), long_group("give up"), on_event=hook)
    finally:
        stop_all([px])
    err = from_rpc_error(info.value)
    assert (err.code, err.reason, err.retry_after_s) == (grpc.StatusCode.UNAVAILABLE, Reason.ATTEMPTS_EXHAUSTED, 1.0)
    assert "failed on 1 attempts" in err.message and by_id[removed[0]].target in err.message
    assert "removed" in err.message and "retry the request" in err.message


def test_200_groups_from_16_clients_survive_a_kill_and_a_restart(cluster, tiny_model, workdir):
    (a, b, _c), proxy, started = cluster
    fp = fingerprint(proxy.target)
    v1, v2 = make_adapter(tiny_model, seed=31), make_adapter(tiny_model, seed=32)
    push(proxy.target, v1.manifest("chaos", 1, fp), v1.payload)
    redone_before = redone(proxy)
    total, clients, deadline = 200, 16, 30.0
    todo = list(range(total))[::-1]
    results: dict[str, list[GroupResult]] = defaultdict(list)
    errors: list = []
    lock = threading.Lock()
    kill_now, restart_now, b_is_back = threading.Event(), threading.Event(), threading.Event()

    def client():
        with grpc.insecure_channel(proxy.target) as channel:
            stub = generator_pb2_grpc.GeneratorServiceStub(channel)
            while True:
                with lock:
                    if not todo:
                        return
                    i = todo.pop()
                if i >= 150:  # the last quarter runs once b is back, so it must serve some
                    b_is_back.wait(120)
                req = request(
                    f"chaos {i % 40}: ", n=2, max_new_tokens=8, adapter="chaos", request_id=f"group-{i}", seed=i
                )
                try:
                    result = run_group(stub, req, timeout=deadline)
                except (grpc.RpcError, AssertionError) as exc:
                    with lock:
                        errors.append((i, exc))
                    continue
                with lock:
                    results[result.request_id].append(result)
                    done = sum(len(v) for v in results.values())
                (kill_now if done == 40 else restart_now if done == 70 else threading.Event()).set()

    t0 = time.monotonic()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    assert kill_now.wait(120)
    a.proc.kill()  # SIGKILL mid-run: its groups fail before or after their first token
    assert restart_now.wait(120)
    b.stop()  # SIGTERM: b finishes its groups and exits; then v2 is pushed while it is away
    reply = push(proxy.target, v2.manifest("chaos", 2, fp), v2.payload)
    pushed_at = time.monotonic()
    assert {r.replica: r.code for r in reply.replicas} == {"a": "UNAVAILABLE", "b": "UNAVAILABLE", "c": "OK"}
    b2 = start_generator(
        tiny_model, workdir, "b-restarted", *GENERATOR_ARGS, "--replica-id", "b-restarted", "--port", str(b.port)
    )  # the same address: it comes back, empty
    started.append(b2)
    wait_until(
        lambda: getattr(routable(proxy).get(b.target), "replica", "") == "b-restarted", 30, "b is back in rotation"
    )
    b_is_back.set()
    for t in threads:
        t.join(180)
    wall = time.monotonic() - t0

    assert errors == []
    assert sorted(results) == sorted(f"group-{i}" for i in range(total))  # none lost
    assert all(len(v) == 1 for v in results.values())  # none completed twice
    groups = [v[0] for v in results.values()]
    assert max(g.seconds for g in groups) < deadline
    assert {g.version for g in groups if g.sent_at > pushed_at} == {2}
    on_b2 = [g for g in groups if g.replica == "b-restarted"]
    assert on_b2 and {g.version for g in on_b2} == {2}
    assert [list(x.versions) for x in status(b2.target).adapters if x.name == "chaos"] == [[1, 2]]
    events = [json.loads(line) for line in b2.log_path.read_text().splitlines() if line.startswith("{")]
    first_v2 = next(i for i, e in enumerate(events) if e["event"] == "adapter_pushed" and e["version"] == 2)
    first_generate = next(i for i, e in enumerate(events) if e["event"] == "generate_start")
    assert first_v2 < first_generate  # caught up before it served anything
    retries, restarts, resumes = (now - before for now, before in zip(redone(proxy), redone_before, strict=True))
    seen_restarts = sum(g.restarts for g in groups)
    print(
        f"chaos: {total} groups in {wall:.1f}s; latency median {statistics.median(g.seconds for g in groups) * 1000:.0f} ms, "
        f"max {max(g.seconds for g in groups):.2f}s; invisible retries {retries:.0f}, resumes {resumes:.0f}, "
        f"restarts {restarts:.0f} (clients saw {seen_restarts}); groups on b-restarted {len(on_b2)}"
    )
    assert retries + resumes + restarts >= 1  # the kill did cut groups off, and they were redone
    assert restarts == seen_restarts  # every restart the proxy made was announced to its client


def redone(proxy) -> tuple[float, float, float]:
    """The proxy's invisible retries, visible restarts and resumes so far, over all replicas."""
    lines = proxy.metrics().splitlines()
    names = ("rollwire_proxy_retries_total", "rollwire_proxy_restarts_total", "rollwire_proxy_resumes_total")
    retries, restarts, resumes = (sum(float(x.split()[-1]) for x in lines if x.startswith(n + "{")) for n in names)
    return retries, restarts, resumes


pytestmark = pytest.mark.integration  # starts processes or servers: not in make test-fast
