"""Fairness at the proxy (issue 11, build item 5): one client's load or a client that stops
reading harms only itself.

- the dispatcher serves clients' queues round robin: one client's many queued groups do not
  starve another's one;
- per-client limits (open requests, queued work) refuse with RESOURCE_EXHAUSTED, reason
  CLIENT_LIMIT, and a retry hint, before any work, and only the client over its limit;
- a client that opens a stream and never reads it is cut off after
  `fairness.slow_reader_timeout_s`: its replica slot frees, the replica is not blamed, and
  the other clients' requests complete (counted).
End-to-end parts run a proxy with bearer-token auth (each token is one client) over two real
tiny-model replicas.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import pytest

from rollwire.common.errors import ResourceExhausted, from_rpc_error
from rollwire.common.reasons import Reason
from rollwire.proxy.config import FairnessSection, ProxyConfig, RoutingSection
from rollwire.proxy.metrics import ProxyMetrics
from rollwire.proxy.policies import make_policy
from rollwire.proxy.routing.dispatch import Client, Dispatcher, Need
from rollwire.runtime.security import caller_identity
from rollwire.v1 import generator_pb2 as pb
from rollwire.v1 import generator_pb2_grpc


# -- the dispatcher, in process --------------------------------------------------------------
@dataclass(eq=False)
class FakeReplica:
    address: str
    in_flight: int = 0
    work: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def holds(self, name, version):
        return True

    def candidate(self):
        from rollwire.proxy.policies import Candidate

        return Candidate(self.address, self.in_flight, self.work)


class FakeReplicas:
    def __init__(self, members):
        self.members = members

    def routable(self):
        return list(self.members)

    def get(self, address):
        return next((r for r in self.members if r.address == address), None)

    def describe(self):
        return "fake"


def dispatcher(slots=1, **fairness) -> Dispatcher:
    replicas = FakeReplicas([FakeReplica("r")])
    routing = RoutingSection(max_in_flight_per_replica=slots, retry_after_s=0.5)
    return Dispatcher(
        replicas, make_policy("round-robin", routing), routing, ProxyMetrics("round-robin"), FairnessSection(**fairness)
    )


def test_queued_clients_are_served_round_robin_not_first_come_first_served():
    async def scenario():
        d = dispatcher(slots=1)
        deadline = time.monotonic() + 30
        a, b = Client("a"), Client("b")
        held = await d.acquire(Need(), b"", 1, frozenset(), deadline, client=a)  # a holds the only slot
        order: list[str] = []

        async def group(client: Client):
            lease = await d.acquire(Need(), b"", 1, frozenset(), deadline, client=client)
            order.append(client.name)
            await asyncio.sleep(0)  # hold the slot for one loop turn, then give it back
            lease.release()

        tasks = [asyncio.create_task(group(a)) for _ in range(50)]  # a queues 50 groups...
        await asyncio.sleep(0)
        tasks += [asyncio.create_task(group(b)) for _ in range(2)]  # ...then b queues 2
        await asyncio.sleep(0)
        assert d.queued() == 52
        held.release()
        await asyncio.gather(*tasks)
        return order

    order = asyncio.run(scenario())
    # b's groups are not behind a's 50: each waits for at most one of a's
    assert order[:4] == ["b", "a", "b", "a"], order[:6]
    assert order.count("a") == 50 and order.count("b") == 2


def test_per_client_limits_refuse_only_that_client_with_a_retry_hint():
    async def scenario():
        d = dispatcher(slots=1, max_in_flight_per_client=2, max_queued_tokens_per_client=100)
        deadline = time.monotonic() + 30
        with d.admit("a") as a1, d.admit("a"):
            with pytest.raises(ResourceExhausted) as info, d.admit("a"):
                pass
            assert (info.value.reason, info.value.retry_after_s) == (Reason.CLIENT_LIMIT, 0.5)
            with d.admit("b") as b:  # another client is not affected
                held = await d.acquire(Need(), b"", 10, frozenset(), deadline, client=b)
                # a's first queued request is accepted however large; the next over the limit is refused
                first = asyncio.create_task(d.acquire(Need(), b"", 500, frozenset(), deadline, client=a1))
                await asyncio.sleep(0)
                assert a1.queued_work == 500
                with pytest.raises(ResourceExhausted) as queued:
                    await d.acquire(Need(), b"", 1, frozenset(), deadline, client=a1)
                assert queued.value.reason == Reason.CLIENT_LIMIT and "tokens of work" in queued.value.message
                # a retry of an admitted request is not refused for the client's queued work
                retry = asyncio.create_task(d.acquire(Need(), b"", 1, frozenset(), deadline, client=a1, first=False))
                # b queues beside a's big one
                other = asyncio.create_task(d.acquire(Need(), b"", 50, frozenset(), deadline, client=b))
                await asyncio.sleep(0)
                assert d.queued() == 3
                held.release()
                for task in (first, other, retry):
                    (await task).release()
        assert d.clients == {} and d.queued() == 0  # nothing of a client stays once it is done
        return d

    d = asyncio.run(scenario())
    values = {
        s.labels["limit"]: s.value
        for f in d.metrics.registry.collect()
        if f.name == "rollwire_proxy_client_limited"
        for s in f.samples
        if s.name.endswith("_total")
    }
    assert values == {
        "in_flight": 1.0,
        "queued_tokens": 1.0,
        "slow_reader": 0.0,
        "slow_upload": 0.0,
    }  # every limit exists from 0


def test_a_client_is_its_token_where_auth_is_on_and_its_host_otherwise():
    token = "s3cret-token-value"
    meta = (("authorization", f"Bearer {token}"),)
    name = caller_identity(meta, "ipv4:10.0.0.5:41234", auth=True)
    assert (
        name.startswith("token:") and token not in name and name == caller_identity(meta, "ipv4:10.0.0.9:1", auth=True)
    )
    assert (
        caller_identity(meta, "ipv4:10.0.0.5:41234", auth=False) == "ipv4:10.0.0.5"
    )  # a header is not an identity without auth
    assert caller_identity((), "ipv4:10.0.0.5:41234", auth=False) == caller_identity((), "ipv4:10.0.0.5:5", auth=False)
    assert caller_identity((), "ipv6:[::1]:5000", auth=False) == "ipv6:[::1]"
    assert caller_identity((), "ipv6:%5B::1%5D:5000", auth=False) == "ipv6:%5B::1%5D"


def test_the_fairness_section_is_typed_with_descriptions():
    config = ProxyConfig()
    assert config.fairness.max_in_flight_per_client >= 1 and config.fairness.slow_reader_timeout_s > 0
    for name, info in FairnessSection.model_fields.items():
        assert info.description, name
    with pytest.raises(ValueError):
        FairnessSection(slow_reader_timeout_s=0)


# -- end to end: tokens as clients, two real replicas ---------------------------------------
TOKENS = {"greedy": "token-greedy-0123456789", "polite": "token-polite-0123456789", "reader": "token-reader-0123456789"}


def auth(who: str):
    return (("authorization", f"Bearer {TOKENS[who]}"),)


@pytest.fixture(scope="module")
def fleet(tiny_model, tmp_path_factory):
    from support.processes import start_generator, start_proxy, stop_all, wait_until

    workdir = tmp_path_factory.mktemp("fairness")
    tokens = workdir / "generate.tokens"
    tokens.write_text("\n".join(TOKENS.values()) + "\n")
    (workdir / "admin.tokens").write_text(ADMIN_TOKEN + "\n")  # the fleet's topology is shown to admins only
    args = ("--set", "limits.max_n=64", "--set", "limits.max_new_tokens=256", "--set", "transformers.threads=1")
    replicas = [start_generator(tiny_model, workdir, n, *args, "--replica-id", n) for n in ("q1", "q2")]
    proxy = start_proxy(
        workdir,
        "fair-proxy",
        replicas,
        "--set",
        f"auth.generate_tokens_file={tokens}",
        "--set",
        f"auth.admin_tokens_file={workdir / 'admin.tokens'}",
        "--set",
        "routing.max_in_flight_per_replica=1",
        "--set",
        "fairness.max_in_flight_per_client=5",
        "--set",
        "fairness.slow_reader_timeout_s=1.0",
    )
    wait_until(lambda: len(routable(proxy)) == 2, 30, "both replicas are routable")
    yield proxy, replicas
    stop_all([proxy, *replicas])


ADMIN_TOKEN = "fairness-admin-token"


def status(proxy) -> pb.GetStatusResponse:
    with grpc.insecure_channel(proxy.target) as ch:
        return generator_pb2_grpc.GeneratorServiceStub(ch).GetStatus(
            pb.GetStatusRequest(), timeout=10, metadata=(("authorization", f"Bearer {ADMIN_TOKEN}"),)
        )


def routable(proxy):
    return [r for r in status(proxy).replicas if r.healthy]


def small(i: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=f"{i}+1=", n=2, sampling=pb.SamplingParams(max_new_tokens=4, seed=i))


def ejections(metrics: str) -> list[str]:
    return [
        line
        for line in metrics.splitlines()
        if line.startswith("rollwire_proxy_ejections_total{") and float(line.split()[-1]) > 0
    ]


class NonReader:
    """A raw grpc.aio client that opens a Generate stream and never reads it (a flow-control
    window of 16 KiB, no BDP probing, so the proxy's writes block soon)."""

    def __init__(self, target: str, request: pb.GenerateRequest, metadata) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.call = self._run(self._open(target, request, metadata))

    def _run(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _open(self, target, request, metadata):
        options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 16384)]
        self.channel = grpc.aio.insecure_channel(target, options=options)
        call = generator_pb2_grpc.GeneratorServiceStub(self.channel).Generate(request, timeout=60, metadata=metadata)
        await call.initial_metadata()  # the request reached the proxy; nothing is read
        return call

    def read_all(self) -> tuple[int, grpc.StatusCode, str]:
        async def drain():
            count = 0
            try:
                async for _ in self.call:
                    count += 1
            except grpc.aio.AioRpcError as exc:
                return count, exc.code(), from_rpc_error(exc).reason
            return count, grpc.StatusCode.OK, ""

        return self._run(drain())

    def done(self) -> bool:
        async def check():
            return self.call.done()

        return self._run(check())

    def close(self) -> None:
        self._run(self.channel.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def test_a_client_that_never_reads_is_cut_off_and_frees_its_slot(fleet):
    from support.processes import wait_until
    from support.wire import run_group

    proxy, _ = fleet
    big = pb.GenerateRequest(text="long", n=64, sampling=pb.SamplingParams(max_new_tokens=240, ignore_eos=True, seed=1))
    start = time.monotonic()
    stuck = NonReader(proxy.target, big, auth("reader"))
    try:
        # the proxy notices (its write has waited 1 s), cancels the attempt and frees the slot,
        # while the client still has not read a single message
        wait_until(
            lambda: 'rollwire_proxy_client_limited_total{limit="slow_reader"} 1.0' in proxy.metrics(),
            20,
            "the proxy cut the non-reading stream off",
        )
        cut_after = time.monotonic() - start
        wait_until(lambda: status(proxy).in_flight == 0, 10, "the slot of the non-reading stream is free")
        assert not stuck.done()
        # the other clients are served meanwhile: all of them, counted
        with grpc.insecure_channel(proxy.target) as channel:
            stub = generator_pb2_grpc.GeneratorServiceStub(channel)
            with ThreadPoolExecutor(2) as pool:
                results = list(
                    pool.map(lambda i: run_group(stub, small(i), timeout=30, metadata=auth("polite")), range(6))
                )
        assert len(results) == 6
        count, code, reason = stuck.read_all()  # when it finally reads: what was sent, then a clear status
        assert (code, reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, Reason.SLOW_READER) and count >= 1
    finally:
        stuck.close()
    metrics = proxy.metrics()
    assert ejections(metrics) == [] and len(routable(proxy)) == 2
    assert cut_after < 15


def test_one_clients_load_does_not_starve_another_and_its_limit_is_its_own(fleet):
    """`greedy` opens 5 long groups (its limit) on the 2 slots; a 6th is refused at once with
    a retry hint; `polite`'s 2 groups, queued behind greedy's 3, each wait for at most one of
    greedy's (first come first served would make them wait for all 3)."""
    from support.processes import wait_until
    from support.wire import run_group

    proxy, _ = fleet
    long = pb.GenerateRequest(
        text="long", n=16, sampling=pb.SamplingParams(max_new_tokens=200, ignore_eos=True, seed=2)
    )
    finished: list[tuple[str, float]] = []
    lock = threading.Lock()

    def run(who, req):
        with grpc.insecure_channel(proxy.target) as channel:
            run_group(generator_pb2_grpc.GeneratorServiceStub(channel), req, timeout=60, metadata=auth(who))
        with lock:
            finished.append((who, time.monotonic()))

    with ThreadPoolExecutor(7) as pool:
        greedy = [pool.submit(run, "greedy", long) for _ in range(5)]
        wait_until(lambda: status(proxy).queue_depth == 3, 20, "greedy's last 3 groups wait in the queue")
        with grpc.insecure_channel(proxy.target) as channel, pytest.raises(grpc.RpcError) as info:
            list(generator_pb2_grpc.GeneratorServiceStub(channel).Generate(long, timeout=10, metadata=auth("greedy")))
        err = from_rpc_error(info.value)
        assert (err.code, err.reason, err.retry_after_s) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            Reason.CLIENT_LIMIT,
            1.0,
        )
        polite = [pool.submit(run, "polite", small(i)) for i in range(2)]
        for f in greedy + polite:
            f.result(timeout=60)
    order = [who for who, _ in sorted(finished, key=lambda x: x[1])]
    last_polite = len(order) - 1 - order[::-1].index("polite")
    # round robin: greedy 1 ends, polite 1 runs; it ends, greedy 3 runs; greedy 2 ends,
    # polite 2 runs: at most greedy's 2 running groups (+1 placed between) end before polite's last
    assert order.count("greedy") == 5 and order[:last_polite].count("greedy") <= 3, order
    assert order[-2:] == ["greedy", "greedy"], order
    metrics = proxy.metrics()
    assert 'rollwire_proxy_client_limited_total{limit="in_flight"} 1.0' in metrics
    assert ejections(metrics) == []


pytestmark = pytest.mark.integration  # starts processes or servers: not in make test-fast
