"""The adapter registry's slots over many names (issue 35, item 3): with `max_loaded` engine
slots, a load evicts the least recently used version no request holds, whatever its name or
version number, keeps its bytes and loads it again when named; kept bytes go least recently
used first too."""

from __future__ import annotations

import hashlib

from rollwire.common.lora import LoraShape
from rollwire.common.manifest import Manifest
from rollwire.generator.adapters import AdapterRegistry

PAYLOAD = b"\0" * 64  # the registry never reads the bytes: the engine (here a log) does


class EngineLog:
    """Records the engine calls the registry makes (the registry is what is under test)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    async def load(self, handle, manifest, payload) -> None:
        self.calls.append(("load", handle))

    async def unload(self, handle) -> None:
        self.calls.append(("unload", handle))


def manifest(name: str, version: int) -> Manifest:
    digest = hashlib.sha256(PAYLOAD).hexdigest()
    return Manifest(name, version, "fp", LoraShape(4, 8.0, ("q_proj",)), len(PAYLOAD), digest)


def loaded_now(engine: EngineLog) -> set[str]:
    return {h for op, h in engine.calls if op == "load"} - {h for op, h in engine.calls if op == "unload"}


async def push(reg: AdapterRegistry, name: str, version: int) -> None:
    await reg.push(manifest(name, version), PAYLOAD)


async def test_a_full_engine_evicts_the_least_recently_used_version_of_any_name():
    engine = EngineLog()
    reg = AdapterRegistry(engine.load, engine.unload, window=2, max_loaded=3)
    await push(reg, "a", 1)
    await push(reg, "b", 1)
    await push(reg, "b", 2)
    a1 = await reg.take("a", 1)  # a's oldest version number, but used after b1 was pushed
    reg.release(a1)
    b1 = reg.acquire("b", 1)  # only to learn its handle (a take is a use)
    reg.release(b1)
    reg.release(await reg.take("a", 1))  # a1 used again: b1 is now the least recently used
    b2 = reg.acquire("b", 2)  # b's newest: held by a request while a2 arrives
    await push(reg, "a", 2)  # the engine is full: the LRU free version goes, not the lowest version number
    assert loaded_now(engine) == {a1.handle, b2.handle, engine.calls[-1][1]}
    assert ("unload", b1.handle) in engine.calls
    assert reg.loaded() == {"a": [1, 2], "b": [1, 2]}  # b1 still servable: its bytes are kept
    again = await reg.take("b", 1)  # loaded again under a fresh handle; a1 is now the LRU free one
    assert again.handle not in (b1.handle, None)
    assert ("unload", a1.handle) in engine.calls and ("unload", b2.handle) not in engine.calls
    assert len(loaded_now(engine)) == 3
    reg.release(again)
    reg.release(b2)


async def test_when_every_loaded_version_is_held_nothing_is_evicted():
    """Leases are never broken: the load goes to the engine, which decides (a served engine
    refuses with ADAPTER_SLOTS_FULL and the push is retried)."""
    engine = EngineLog()
    reg = AdapterRegistry(engine.load, engine.unload, window=2, max_loaded=2)
    await push(reg, "a", 1)
    await push(reg, "b", 1)
    held = [reg.acquire("a", 1), reg.acquire("b", 1)]
    await push(reg, "c", 1)
    assert not [c for c in engine.calls if c[0] == "unload"]
    assert len(loaded_now(engine)) == 3
    for sel in held:
        reg.release(sel)


async def test_kept_bytes_go_least_recently_used_first_across_names():
    """window 1, room for three payloads: a's v1 was taken after b's v1 was pushed, so b's v1
    (same version number, used less recently) is the one let go."""
    engine = EngineLog()
    reg = AdapterRegistry(engine.load, engine.unload, window=1, keep=4, keep_bytes=3 * len(PAYLOAD))
    await push(reg, "a", 1)
    await push(reg, "b", 1)
    await push(reg, "a", 2)  # a1 leaves the window: kept as bytes
    reg.release(await reg.take("a", 1))
    await push(reg, "b", 2)  # four payloads: one kept version goes
    assert reg.loaded() == {"a": [1, 2], "b": [2]}


def test_a_vllm_replica_sizes_vllms_lora_slots_for_its_adapter_names(tmp_path):
    """vllm.adapter_names x (adapter_window + 1) slots, at vllm.max_lora_rank: what --max-loras
    and --max-cpu-loras say, and what the registry evicts to stay within (app.py)."""
    from rollwire.generator.engines.served.vllm_engine import VLLMEngine
    from rollwire.generator.engines.settings import VLLMSection

    def flags(**settings) -> tuple[int, dict[str, str]]:
        engine = VLLMEngine(tmp_path, VLLMSection(**settings), adapter_window=3)
        argv, _ = engine._launch(8000, None, None)
        named = {a: argv[i + 1] for i, a in enumerate(argv) if a.startswith("--max-lora")}
        named.update({a: argv[i + 1] for i, a in enumerate(argv) if a == "--max-cpu-loras"})
        return engine.max_adapters, named

    assert flags() == (4, {"--max-lora-rank": "64", "--max-loras": "4", "--max-cpu-loras": "4"})
    assert flags(adapter_names=8, max_lora_rank=16) == (
        32,
        {"--max-lora-rank": "16", "--max-loras": "32", "--max-cpu-loras": "32"},
    )
    assert flags(adapter_names=8, max_loaded_adapters=10)[0] == 10
