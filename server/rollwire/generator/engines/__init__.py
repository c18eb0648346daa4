"""The engines, each a module behind the `Engine` protocol (base.py), named once in ENGINES.

ENGINES is the only place an engine's name is written: the config's `engine` field, the
`--engine` choices, `make_engine`, the contract tests (tests/integration/generator/test_engine_contract.py) and the
docs check (tests/unit/repo/test_registries.py) all read it. An entry names a builder
`build(config: EngineConfig, metrics: GeneratorMetrics) -> Engine`; a builder imports its
engine module (and torch) only when a replica builds that engine, so importing this package,
listing the names or validating a config imports nothing heavy. `EngineConfig` is the part of
the generator's config an engine reads (GeneratorConfig has it), and each engine's own section
is defined beside the engines (settings.py): the config imports this package, never the reverse.

Layout: base.py (the Engine protocol), settings.py (each engine's config section), this registry,
and two rooms by where the model runs: embedded/ (in the replica's own process: transformers,
scripted) and served/ (by a model server beside the replica, over one shared skeleton: sglang,
vllm). The rooms never import each other, and nothing of the replica outside this package imports
an engine module: it reaches one through ENGINES and base.Engine (make lint's contracts).

Adding an engine: its module in the room it belongs to, with a `build(config, metrics)`
function, and one line here, `ENGINES.register("name", "rollwire.generator.engines.room.module:build",
"summary")`; its settings section goes in settings.py, its field in GeneratorConfig and in
EngineConfig.
Trait `runs_model=False` marks an engine that serves a folder holding only config.json and
emits scripted tokens, so the contract suite checks no model numbers against it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from rollwire.runtime.registry import Registry

if TYPE_CHECKING:
    from rollwire.generator.engines.base import Engine
    from rollwire.generator.engines.settings import ScriptedSection, SGLangSection, TransformersSection, VLLMSection
    from rollwire.generator.metrics import GeneratorMetrics


class EngineConfig(Protocol):
    """The generator config's keys a builder reads (GeneratorConfig has them all)."""

    model: str
    adapter_window: int
    transformers: TransformersSection
    sglang: SGLangSection
    vllm: VLLMSection
    scripted: ScriptedSection


EngineBuilder = Callable[[EngineConfig, "GeneratorMetrics"], "Engine"]


def _transformers(config: EngineConfig, metrics: GeneratorMetrics) -> Engine:
    from rollwire.generator.engines.embedded.prefix_cache import PrefixCacheSettings
    from rollwire.generator.engines.embedded.transformers_engine import TransformersEngine

    t = config.transformers
    p = t.prefix_cache
    return TransformersEngine(
        config.model,
        max_batch_rows=t.max_batch_rows,
        max_batch_tokens=None if t.max_batch_tokens == "auto" else t.max_batch_tokens,
        kv_memory_fraction=t.kv_memory_fraction,
        threads=t.threads,
        device=t.device,
        on_forward=metrics.on_forward,
        prefix_cache=PrefixCacheSettings(max_tokens=p.max_tokens, ttl_s=p.ttl_s, block_tokens=p.block_tokens),
        metrics=metrics,
        score_batch_tokens=t.score_batch_tokens,
    )


def _sglang(config: EngineConfig, metrics: GeneratorMetrics) -> Engine:
    from rollwire.generator.engines.served.sglang_engine import SGLangEngine

    return SGLangEngine(config.model, config.sglang, adapter_window=config.adapter_window)


def _vllm(config: EngineConfig, metrics: GeneratorMetrics) -> Engine:
    from rollwire.generator.engines.served.vllm_engine import VLLMEngine

    return VLLMEngine(config.model, config.vllm, adapter_window=config.adapter_window)


def _scripted(config: EngineConfig, metrics: GeneratorMetrics) -> Engine:
    from rollwire.generator.engines.embedded.scripted import ScriptedEngine

    s = config.scripted
    return ScriptedEngine(
        config.model, tokens_per_s=s.tokens_per_s, logprob=s.logprob, max_concurrent_groups=s.max_concurrent_groups
    )


ENGINES: Registry[EngineBuilder] = Registry("engine")
ENGINES.register("transformers", _transformers, "transformers + PEFT in the replica's own process; CPU or GPU")
ENGINES.register("sglang", _sglang, "a real SGLang server, launched by the replica or reached by URL; NVIDIA GPU")
ENGINES.register(
    "vllm",
    _vllm,
    "a real vLLM OpenAI server in its own environment, launched by the replica or reached by URL; CPU or GPU",
)
ENGINES.register(
    "scripted", _scripted, "benchmark engine: tokens at a set rate from config.json alone, no model", runs_model=False
)

__all__ = ["ENGINES", "EngineBuilder", "EngineConfig"]
