"""Keepalive, one set of numbers for both sides (rollwire.common.keepalive): a client pinging
as often as a rollwire channel may is never refused by a rollwire server, and a server that
goes silent is noticed within `bound_s`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from rollwire.client._channels import open_channel
from rollwire.common.keepalive import BULK_PING_TIMEOUT_S, DEFAULT, MIN_PING_INTERVAL_S, Keepalive, for_pushes
from rollwire.runtime.config import ConfigError, load_config
from rollwire.serving.scaffold import server_options

FAST = Keepalive(time_s=MIN_PING_INTERVAL_S, timeout_s=1.0)


def test_the_numbers_agree_and_are_checked():
    assert DEFAULT.bound_s == DEFAULT.time_s + DEFAULT.timeout_s == 10.0
    channel, server = dict(DEFAULT.channel_options()), dict(DEFAULT.server_options())
    # the ping deadline gRPC 1.85 really applies is http2.ping_timeout_ms (60 s by default)
    assert channel["grpc.http2.ping_timeout_ms"] == channel["grpc.keepalive_timeout_ms"] == 5000
    assert channel["grpc.http2.max_pings_without_data"] == 0 and channel["grpc.keepalive_permit_without_calls"] == 1
    assert server["grpc.http2.min_ping_interval_without_data_ms"] <= 1000 * MIN_PING_INTERVAL_S
    # a server pings as often as a channel, and waits for the answer as long as a push connection
    assert server["grpc.keepalive_time_ms"] == channel["grpc.keepalive_time_ms"] == 5000
    assert server["grpc.http2.ping_timeout_ms"] == server["grpc.keepalive_timeout_ms"] == BULK_PING_TIMEOUT_S * 1000
    assert server["grpc.keepalive_permit_without_calls"] == 1
    assert channel["grpc.min_reconnect_backoff_ms"] == 5000  # gRPC's connect timeout, despite the name
    for bad in (dict(time_s=0.5), dict(timeout_s=0.0), dict(time_s=7200)):
        with pytest.raises(ValueError, match="keepalive"):
            Keepalive(**bad)


def test_a_push_connection_waits_longer_for_a_ping_answer_and_changes_nothing_else():
    """A ping on a push connection queues behind the push's bytes: only its deadline grows."""
    for keepalive in (DEFAULT, FAST, Keepalive(time_s=5, timeout_s=90)):
        plain = dict(keepalive.channel_options())
        bulk = dict(for_pushes(keepalive.channel_options()))
        changed = {key for key in plain if plain[key] != bulk[key]}
        assert bulk.keys() == plain.keys()
        assert changed <= {"grpc.keepalive_timeout_ms", "grpc.http2.ping_timeout_ms"}
        for key in ("grpc.keepalive_timeout_ms", "grpc.http2.ping_timeout_ms"):
            assert bulk[key] == max(plain[key], round(BULK_PING_TIMEOUT_S * 1000))


def test_the_config_section_refuses_pings_a_server_would_refuse(tmp_path):
    from rollwire.proxy.config import ProxyConfig

    with pytest.raises(ConfigError, match="keepalive.time_s"):
        load_config(ProxyConfig, None, ["keepalive.time_s=0.2"])
    config = load_config(ProxyConfig, None, ["keepalive.time_s=2", "keepalive.timeout_s=3"])
    assert config.keepalive.keepalive().bound_s == 5.0


def idle_watch(server_opts, seconds: float) -> grpc.StatusCode:
    """Hold an idle Health.Watch stream open on a rollwire channel with FAST keepalive for
    `seconds`; the code it ends with (DEADLINE_EXCEEDED: nothing went wrong)."""
    server = grpc.server(futures.ThreadPoolExecutor(4), options=server_opts)
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        channel = open_channel(f"127.0.0.1:{port}", None, grpc, FAST)
        stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=seconds)
        try:
            for _ in stream:
                pass
        except grpc.RpcError as exc:
            return exc.code()
        finally:
            channel.close()
        return grpc.StatusCode.OK
    finally:
        server.stop(0)


def test_a_rollwire_server_accepts_the_fastest_pings_a_rollwire_channel_sends():
    assert idle_watch(server_options(FAST), 4.5) == grpc.StatusCode.DEADLINE_EXCEEDED
    # the control: gRPC's own server defaults answer the same pings with GOAWAY too_many_pings
    assert idle_watch([], 4.5) == grpc.StatusCode.UNAVAILABLE


SERVER = textwrap.dedent(
    """
    import sys, time
    from concurrent import futures
    import grpc
    from grpc_health.v1 import health, health_pb2_grpc
    from rollwire.common.keepalive import Keepalive
    from rollwire.serving.scaffold import server_options
    server = grpc.server(futures.ThreadPoolExecutor(2), options=server_options(Keepalive(1.0, 1.0)))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    print(server.add_insecure_port("127.0.0.1:0"), flush=True)
    server.start()
    time.sleep(120)
    """
)


def test_a_frozen_server_is_noticed_within_the_bound():
    """SIGSTOP leaves the socket open (the kernel still ACKs): only keepalive can tell."""
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        channel = open_channel(f"127.0.0.1:{port}", None, grpc, FAST)
        stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=30)
        next(stream)  # the stream is up
        os.kill(proc.pid, signal.SIGSTOP)
        frozen = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            next(stream)
        noticed = time.monotonic() - frozen
        channel.close()
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "ping timeout" in info.value.details()
    assert noticed < FAST.bound_s + 1.0


pytestmark = pytest.mark.integration  # starts a gRPC server and a process: not in make test-fast
