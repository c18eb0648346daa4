"""Assembling and running one generator replica: engine, gRPC server, health, metrics."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from rollwire.common.fingerprint import model_fingerprint
from rollwire.common.logs import get_logger
from rollwire.server.adapters import AdapterRegistry, base_linear_shapes
from rollwire.server.config import GeneratorConfig
from rollwire.server.metrics import GeneratorMetrics
from rollwire.server.security import add_port, interceptors, start_health_port, warn_if_exposed
from rollwire.server.servicer import GeneratorServicer
from rollwire.v1 import generator_pb2, generator_pb2_grpc

log = get_logger(__name__)
SERVICE = generator_pb2.DESCRIPTOR.services_by_name["GeneratorService"].full_name
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", 8 << 20),  # room to refuse an oversized chunk ourselves
    ("grpc.max_send_message_length", 8 << 20),
    ("grpc.so_reuseport", 0),
]


def make_engine(config: GeneratorConfig, metrics: GeneratorMetrics):
    """The configured engine; each backend lives in its own module."""
    if config.engine == "transformers":
        from rollwire.server.engines.transformers_engine import TransformersEngine

        t = config.transformers
        return TransformersEngine(
            config.model, max_batch_rows=t.max_batch_rows, threads=t.threads, device=t.device, on_forward=metrics.on_forward
        )
    if config.engine == "sglang":
        from rollwire.server.engines.sglang_engine import SGLangEngine

        return SGLangEngine.from_config(config)
    if config.engine == "scripted":
        from rollwire.server.engines.scripted import ScriptedEngine

        s = config.scripted
        return ScriptedEngine(
            config.model, tokens_per_s=s.tokens_per_s, logprob=s.logprob, max_concurrent_groups=s.max_concurrent_groups
        )
    raise NotImplementedError(f"engine {config.engine!r} is not available in this build")


@dataclass
class RunningGenerator:
    """A started replica: its ports and the pieces tests and the proxy may inspect."""

    server: grpc.aio.Server
    servicer: GeneratorServicer
    health: health.aio.HealthServicer
    port: int
    metrics_port: int
    metrics_server: object
    probe_server: grpc.aio.Server | None = None

    async def stop(self, grace: float) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        if self.probe_server:
            await self.probe_server.stop(0)
        await self.servicer.engine.close()
        self.metrics_server.shutdown()


async def start_generator(config: GeneratorConfig) -> RunningGenerator:
    """Load the model, then listen; health turns SERVING only when requests can be served."""
    if not config.model or not Path(config.model, "config.json").is_file():
        raise SystemExit(f"--model {config.model or '(missing)'} is not a local Hugging Face model folder with config.json")
    metrics = GeneratorMetrics()
    metrics_server, _ = start_http_server(config.metrics_port, addr=config.host, registry=metrics.registry)
    metrics_port = metrics_server.server_port
    engine = make_engine(config, metrics)
    await engine.start()
    metrics.queue_depth.set_function(lambda: engine.stats().queued)
    metrics.running.set_function(lambda: engine.stats().running)
    config_only = config.engine == "scripted"  # the benchmark engine may serve a folder without weights
    fingerprint = await asyncio.to_thread(model_fingerprint, config.model, config_only=config_only)
    registry = AdapterRegistry(engine.load_adapter, engine.unload_adapter, config.adapter_window)
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors(config.auth))
    port = add_port(server, f"{config.host}:{config.port}", config.tls)
    if port == 0:
        raise SystemExit(f"cannot listen on {config.host}:{config.port}; is the port in use?")
    warn_if_exposed("generator", config.host, port, config.auth, config.tls, metrics_port)
    replica = config.replica_id or f"{config.host}:{port}"
    servicer = GeneratorServicer(
        config,
        engine,
        registry,
        metrics,
        fingerprint=fingerprint,
        base_shapes=base_linear_shapes(config.model, config_only=config_only),
        replica=replica,
    )
    generator_pb2_grpc.add_GeneratorServiceServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    await server.start()
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    probe_server = await start_health_port(health_servicer, config.host, config.tls)
    log.info("generator_ready", replica=replica, port=port, metrics_port=metrics_port, fingerprint=fingerprint)
    return RunningGenerator(server, servicer, health_servicer, port, metrics_port, metrics_server, probe_server)


async def run_generator(config: GeneratorConfig, ready_file: str | None = None, registration=None) -> None:
    """Serve until SIGINT/SIGTERM, then stop taking work and let in-flight requests finish.

    With a `registration` (rollwire.server.proxy.registration.Registration) the replica joins
    that proxy with heartbeats, and on shutdown has the proxy drain it before it stops.
    """
    running = await start_generator(config)
    heartbeat = None
    if registration is not None:
        from rollwire.server.proxy.registration import Heartbeat

        heartbeat = Heartbeat(registration, registration.address or f"{config.host}:{running.port}")
        heartbeat.start()
    if ready_file:
        write_ready_file(ready_file, {"port": running.port, "metrics_port": running.metrics_port, "pid": os.getpid()})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("generator_stopping", grace_seconds=config.grace_seconds)
    if heartbeat is not None:
        await heartbeat.leave(config.grace_seconds)
    await running.stop(config.grace_seconds)


def write_ready_file(path: str, data: dict) -> None:
    """Atomically write the ports a supervisor or test waits for."""
    tmp = f"{path}.tmp"
    Path(tmp).write_text(json.dumps(data))
    os.replace(tmp, path)
