"""Assembling and running one generator replica: engine, gRPC server, health, metrics."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from rollwire.common.fingerprint import model_fingerprint
from rollwire.generator.adapters import AdapterRegistry
from rollwire.generator.config import GeneratorConfig
from rollwire.generator.engines import ENGINES
from rollwire.generator.engines.base import Engine
from rollwire.generator.metrics import GeneratorMetrics
from rollwire.generator.proof import Prover
from rollwire.generator.servicer import GeneratorServicer
from rollwire.generator.shapes import base_linear_shapes
from rollwire.runtime.logs import get_logger
from rollwire.runtime.members import MemberCheck, member_token, read_member_key, read_trusted
from rollwire.serving.scaffold import Running, listen, serve
from rollwire.v1 import generator_pb2, generator_pb2_grpc

log = get_logger(__name__)
SERVICE = generator_pb2.DESCRIPTOR.services_by_name["GeneratorService"].full_name
T = TypeVar("T")


def make_engine(config: GeneratorConfig, metrics: GeneratorMetrics) -> Engine:
    """The configured engine, built by the builder registered under its name (engines/__init__.py)."""
    return ENGINES.load(config.engine)(config, metrics)


@dataclass
class RunningGenerator(Running):
    """A started replica: its endpoint and the servicer tests may inspect."""

    servicer: GeneratorServicer

    async def close(self) -> None:
        await self.servicer.close()
        await self.servicer.engine.close()


async def start_generator(config: GeneratorConfig) -> RunningGenerator:
    """Load the model, then listen; health turns SERVING only when requests can be served."""
    if not config.model or not Path(config.model, "config.json").is_file():
        raise SystemExit(
            f"--model {config.model or '(missing)'} is not a local Hugging Face model folder with config.json"
        )
    config_only = not ENGINES.entry(config.engine).traits.get("runs_model", True)  # may serve config.json alone
    hashing = _in_background(model_fingerprint, config.model, config_only=config_only)  # while the engine loads
    metrics = GeneratorMetrics()
    engine = make_engine(config, metrics)
    await engine.start()
    metrics.queue_depth.set_function(lambda: engine.stats().queued)
    metrics.running.set_function(lambda: engine.stats().running)
    fingerprint = await asyncio.wrap_future(hashing)
    registry, prover = _registry(config, engine, metrics)
    endpoint = listen("generator", config, metrics.registry)
    replica = config.replica_id or f"{config.host}:{endpoint.port}"
    prover.replica = replica
    servicer = GeneratorServicer(
        config,
        engine,
        registry,
        metrics,
        fingerprint=fingerprint,
        base_shapes=base_linear_shapes(config.model, config_only=config_only),
        replica=replica,
        auth=endpoint.auth,
        port=endpoint.port,
        prover=prover,
    )
    key = read_member_key(config.auth.member_key_file, "auth.member_key_file")
    trusted = read_trusted(config.auth.member_trust_file, "auth.member_trust_file")
    advertised = config.registration.advertise or f"{config.host}:{endpoint.port}"
    if trusted is not None and endpoint.auth is not None:  # a proxy's signature of this address: none can mint it
        endpoint.auth.accept_signed_members(MemberCheck(trusted, advertised))
    if key is not None and endpoint.auth is not None:  # its proxy's credential, for this address only
        if trusted is None:  # every holder of the fleet key can derive it: only without signed members
            endpoint.auth.accept_member(member_token(key, advertised))
        servicer.member = (key, advertised)
    generator_pb2_grpc.add_GeneratorServiceServicer_to_server(servicer, endpoint.server)
    await endpoint.start([SERVICE], config.host, config.tls)
    for name in ("", SERVICE):
        await endpoint.set_health(name, True)
    _follow_server_health(engine, endpoint)
    log.info(
        "generator_ready",
        replica=replica,
        port=endpoint.port,
        metrics_port=endpoint.metrics_port,
        fingerprint=fingerprint,
    )
    return RunningGenerator(endpoint, servicer)


def _registry(config: GeneratorConfig, engine: Engine, metrics: GeneratorMetrics) -> tuple[AdapterRegistry, Prover]:
    """The replica's adapter registry over its engine, and the prover that holds each version to its probe."""
    trusted = config.trust.trusted().required
    prover = Prover(engine, metrics, tolerance=config.proof.tolerance, trusted=trusted, replica=config.replica_id)
    registry = AdapterRegistry(
        engine.load_adapter,
        engine.unload_adapter,
        config.adapter_window,
        config.limits.stage_timeout_s,
        keep=config.adapter_keep,
        keep_bytes=config.adapter_keep_bytes,
        max_loaded=getattr(engine, "max_adapters", 0),  # a served engine's LoRA slots; the embedded engine has no limit
        tenant_slots=config.tenant_slots,  # every engine, the embedded one too
        on_decision=lambda outcome: metrics.adapter_slot_decisions.labels(outcome).inc(),
        prove=prover.prove,  # every version with a probe is held to it before it is served
    )
    return registry, prover


def _in_background(fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
    """`fn(*args, **kwargs)` on a daemon thread of its own, its result in the future.

    The fingerprint reads every weight byte (seconds for a model of a few GB; hashlib releases
    the GIL), so it runs while the engine loads instead of after it. A daemon thread, unlike
    the loop's executor, never holds up the exit of a replica whose engine failed to start."""
    future: Future[T] = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # handed to whoever awaits it
            future.set_exception(exc)

    threading.Thread(target=run, name=f"rollwire-{getattr(fn, '__name__', 'task')}", daemon=True).start()
    return future


def _follow_server_health(engine: Engine, endpoint) -> None:
    """An engine whose model runs in a server beside the replica (engines/served/: sglang, vllm)
    turns the replica's gRPC health NOT_SERVING while that server is down and SERVING when it
    is back, so a proxy stops routing to it at once instead of after failed requests."""
    supervisor = getattr(engine, "supervisor", None)
    listeners = getattr(supervisor, "listeners", None)
    if not isinstance(listeners, list):
        return

    async def follow(up: bool) -> None:
        for name in ("", SERVICE):
            await endpoint.set_health(name, up)

    listeners.append(follow)


async def run_generator(config: GeneratorConfig, ready_file: str | None = None, registration=None) -> None:
    """Serve until SIGINT/SIGTERM, then stop taking work and let in-flight requests finish.

    With a `registration` (rollwire.generator.registration.Registration) the replica joins
    that proxy with heartbeats, and on shutdown has the proxy drain it before it stops.
    """
    running = await start_generator(config)
    if registration is None:
        await serve("generator", running, config, ready_file)
        return
    from rollwire.generator.registration import Heartbeat

    heartbeat = Heartbeat(registration, registration.address or f"{config.host}:{running.port}")
    heartbeat.start()
    await serve("generator", running, config, ready_file, lambda: heartbeat.leave(config.grace_seconds))
