"""Resume, not restart (issue 37, item 1): a proxy over two transformers replicas, a seeded
group of long samples while both replicas are under load, and the replica serving it
SIGKILLed once some of its samples finished and the others are mid-way. The client sees no
`restarted` and no second `started`; every sample's tokens equal the uninterrupted run's (the
same request, run beforehand on the same fleet) and its logprobs agree within 1e-5; the proxy
counts one resume and no restart; the finished samples are not run again.

It kills a replica, so it starts its own fleet (docs/testing.md). The pieces in-process (the
RNG skip, the replica's validation of `resume`, each engine's continuation, the proxy's
bookkeeping): tests/unit/generator/test_resume_samples.py, tests/unit/proxy/test_resume_progress.py.
"""

from __future__ import annotations

import itertools
import json
import threading
from dataclasses import dataclass, field

import grpc
import pytest
from support.processes import start_generators, start_proxy, stop_all, wait_routable
from support.wire import metric_value, request

from rollwire.v1 import generator_pb2 as pb
from rollwire.v1 import generator_pb2_grpc

N, MAX_NEW = 8, 128


@pytest.fixture(scope="module")
def fleet(tiny_model, workdir):
    replicas = start_generators(tiny_model, workdir, ["ra", "rb"])
    proxy = start_proxy(workdir, "resume-proxy", replicas)
    wait_routable(proxy, replicas)
    yield replicas, proxy
    stop_all([proxy, *replicas])


@dataclass
class Stream:
    """One Generate stream as its client saw it."""

    tokens: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list[float]] = field(default_factory=dict)
    text: dict[int, str] = field(default_factory=dict)
    finished: dict[int, pb.SampleFinished] = field(default_factory=dict)
    started: list[pb.GenerationStarted] = field(default_factory=list)
    restarts: int = 0

    def read(self, call, on_message=lambda stream, msg: None) -> Stream:
        for msg in call:
            if msg.HasField("restarted"):
                self.restarts += 1
            if msg.HasField("started"):
                self.started.append(msg.started)
            for t in msg.tokens:
                assert t.sample_index not in self.finished, "tokens after the sample finished"
                self.tokens.setdefault(t.sample_index, []).extend(t.token_ids)
                self.logprobs.setdefault(t.sample_index, []).extend(t.logprobs)
                self.text[t.sample_index] = self.text.get(t.sample_index, "") + t.text
            for f in msg.finished:
                assert f.sample_index not in self.finished, "a sample finished twice"
                self.finished[f.sample_index] = f
            on_message(self, msg)
        return self


def group(seed: int) -> pb.GenerateRequest:
    return request("resume: ", n=N, max_new_tokens=MAX_NEW, seed=seed, temperature=1.0, request_id=f"resume-{seed}")


def spread(run: Stream) -> bool:
    """Some samples end (EOS) at least 60 tokens before every longer one: once the first of
    them ended, the others are still far from their end, so a kill then tests both kinds."""
    lengths = sorted({len(t) for t in run.tokens.values()})
    return any(short >= 4 and longer - short >= 60 for short, longer in itertools.pairwise(lengths))


def load(targets: list[str], stop: threading.Event) -> list[threading.Thread]:
    """Groups sent to the replicas directly (not through the proxy, whose counters the test
    reads), one after the other per thread, until `stop`; the killed replica's fail, as they may."""

    def run(target: str, k: int) -> None:
        with grpc.insecure_channel(target) as channel:
            stub = generator_pb2_grpc.GeneratorServiceStub(channel)
            while not stop.is_set():
                req = request(f"load {k}: ", n=4, max_new_tokens=64, ignore_eos=True, seed=k)
                try:
                    for _ in stub.Generate(req, timeout=60):
                        pass
                except grpc.RpcError:
                    if stop.wait(0.2):
                        return

    threads = [threading.Thread(target=run, args=(t, k), daemon=True) for k, t in enumerate(targets * 2)]
    for t in threads:
        t.start()
    return threads


def events(service, name: str) -> list[dict]:
    lines = service.log_path.read_text().splitlines()
    return [e for e in (json.loads(x) for x in lines if x.startswith("{")) if e.get("event") == name]


def test_a_replica_killed_mid_group_costs_no_token_and_changes_none(fleet):
    replicas, proxy = fleet
    by_id = {r.name: r for r in replicas}
    with grpc.insecure_channel(proxy.target) as channel:
        stub = generator_pb2_grpc.GeneratorServiceStub(channel)
        for seed in range(1, 40):  # the uninterrupted run, on the same fleet, of a group with a spread
            baseline = Stream().read(stub.Generate(group(seed), timeout=60))
            if spread(baseline):
                break
        else:
            pytest.fail("no seed in 1..39 gave samples of spread lengths")
        before = proxy.metrics()
        stop = threading.Event()
        threads = load([r.target for r in replicas], stop)
        killed: list = []
        finished_at_kill: list[int] = []

        def kill_mid_group(stream: Stream, msg: pb.GenerateResponse) -> None:
            """At the first `finished` while other samples still have 40 tokens to go (by the
            baseline), SIGKILL the replica serving the group: an event of the stream, not a sleep."""
            if killed or not msg.finished:
                return
            running = [i for i in range(N) if i not in stream.finished]
            if running and all(len(baseline.tokens[i]) - len(stream.tokens.get(i, [])) >= 40 for i in running):
                victim = by_id[stream.started[0].replica]
                victim.proc.kill()
                killed.append(victim)
                finished_at_kill.append(len(stream.finished))

        try:
            resumed = Stream().read(stub.Generate(group(seed), timeout=120), kill_mid_group)
        finally:
            stop.set()
            for t in threads:
                t.join(70)
    assert killed, "the group ended before the kill could be placed mid-group"
    victim = killed[0]
    survivor = next(r for r in replicas if r is not victim)

    assert resumed.restarts == 0 and len(resumed.started) == 1  # the client saw no restart, one `started`
    assert resumed.started[0].replica == victim.name
    assert resumed.tokens == baseline.tokens  # every sample, token for token
    for i, lps in baseline.logprobs.items():
        assert max(abs(a - b) for a, b in zip(resumed.logprobs[i], lps, strict=True)) <= 1e-5, i
    assert resumed.text == baseline.text
    for i, f in baseline.finished.items():
        got = resumed.finished[i]
        assert (got.finish_reason, got.completion_tokens, got.prompt_tokens) == (
            f.finish_reason,
            f.completion_tokens,
            f.prompt_tokens,
        )

    after = proxy.metrics()
    count = lambda text, name, **labels: metric_value(  # noqa: E731
        text, name, ",".join(f'{k}="{v}"' for k, v in labels.items())
    )
    for r in replicas:
        assert count(after, "rollwire_proxy_restarts_total", replica=r.target) == count(
            before, "rollwire_proxy_restarts_total", replica=r.target
        )
    resumes = count(after, "rollwire_proxy_resumes_total", replica=victim.target) - count(
        before, "rollwire_proxy_resumes_total", replica=victim.target
    )
    assert resumes == 1
    for cause in ("off", "unsupported", "refused", "limits"):
        assert count(after, "rollwire_proxy_restart_causes_total", cause=cause) == 0

    # the finished samples were not run again: the survivor continued only the others
    failed = [e for e in events(proxy, "attempt_failed") if e.get("then") == "resume"]
    assert len(failed) == 1 and failed[0]["replica"] == victim.target
    left = failed[0]["samples_left"]
    assert 1 <= left <= N - finished_at_kill[0]
    continued = [e for e in events(survivor, "generate_start") if e.get("resumed")]
    assert [e["resumed"] for e in continued] == [left]
    print(
        f"resume: seed {seed}; killed {victim.name} with {finished_at_kill[0]} of {N} samples finished; "
        f"{left} continued on {survivor.name} from {failed[0]['tokens_kept']} tokens kept"
    )


pytestmark = pytest.mark.integration  # starts processes or servers: not in make test-fast
