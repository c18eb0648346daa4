"""Shared pieces of the benchmarks: the tiny model, results files, repeat statistics.

Every benchmark writes bench/results/<name>.json with the machine, the date, the command
that reproduces it and, for each figure, min/median/max over its repeats.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# tests/support holds the network lab (support.netlab) a benchmark may use; it is not shipped.
if str(ROOT / "tests") not in sys.path:
    sys.path.append(str(ROOT / "tests"))
RESULTS = ROOT / "bench" / "results"
WORK = ROOT / "runs" / "bench"


def tiny_model() -> Path:
    """The untrained tiny model (the engines' cost does not depend on what it learned)."""
    from rollwire.demo.tiny_model import build_tiny_model

    path = WORK / "tiny"
    if not (path / "config.json").exists():
        build_tiny_model(path)
    return path


def spread(values: list[float]) -> dict:
    """min / median / max of repeated measurements."""
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


def machine() -> dict:
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def write_result(name: str, command: str, data: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"benchmark": name, "command": command, "machine": machine(), **data}, indent=2))
    print(f"wrote {path.relative_to(ROOT)}", file=sys.stderr)
    return path


class Timer:
    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start


# -- scripted clusters (weight push, proxy overhead, scaling) ---------------------------

QWEN25 = {  # public config.json fields of Qwen2.5 that decide the linear layers' shapes
    "0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, head_dim=64, tie_word_embeddings=True),
    "1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, head_dim=128, tie_word_embeddings=True),
    "7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, head_dim=128, tie_word_embeddings=False),
}  # fmt: skip


def config_only_model(name: str, fields: dict) -> Path:
    """A model folder with only config.json (Qwen2 family), served by the scripted engine."""
    path = WORK / "models" / name
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        **fields,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def scripted_model() -> Path:
    """A small config-only model for the scripted engine, where the proxy's cost is measured
    and the model's must not matter."""
    fields = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=32, tie_word_embeddings=True, vocab_size=1000)  # fmt: skip
    return config_only_model("scripted-small", fields)


def start_scripted(model: Path, count: int, name: str, *settings: str) -> list:
    """`count` scripted replicas of `model`; settings are extra `--set key=value` strings."""
    from rollwire.demo.stack import start_generators

    extra = [a for s in ("engine=scripted", *settings) for a in ("--set", s)]
    return start_generators(model, WORK, [f"{name}-{i}" for i in range(count)], *extra)


def start_proxy(replicas: list, name: str, *settings: str):
    """A proxy in front of `replicas`, returned once every one of them takes traffic."""
    from rollwire.demo.stack import routing
    from rollwire.demo.stack import start_proxy as start

    return routing(start(WORK, name, replicas, *(a for s in settings for a in ("--set", s))), replicas, timeout=60)


def stop_all(processes) -> None:
    from rollwire.demo.stack import stop_all as stop

    stop(processes)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process so far."""
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation."""
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    low = int(k)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


async def closed_loop(
    target: str, workers: int, requests_each: int, n: int, tokens: int, duration_s: float = 0
) -> dict:
    """`workers` clients each sending groups back to back over one AsyncClient: `requests_each`
    groups, or with `duration_s` as many as start before that many seconds have passed.

    Returns per-request latency and time to first token (seconds), completion tokens and
    the wall time from the first send to the last completion.
    """
    from rollwire.client import AsyncClient, Tokens

    latencies, ttfts, counted = [], [], [0]
    start = time.perf_counter()

    def more(i: int) -> bool:
        return time.perf_counter() - start < duration_s if duration_s else i < requests_each

    async def worker(w: int, client) -> None:
        i = 0
        while more(i):
            sent, first = time.perf_counter(), None
            stream = client.generate_stream([1 + w % 50, 2 + i % 50], n, max_new_tokens=tokens, seed=w * 1000 + i)
            async for event in stream:
                if isinstance(event, Tokens):
                    first = first or time.perf_counter()
                    counted[0] += len(event.token_ids)
            latencies.append(time.perf_counter() - sent)
            ttfts.append((first or time.perf_counter()) - sent)
            i += 1

    async with AsyncClient(target, timeout=600) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(w, client) for w in range(workers)))
        wall = time.perf_counter() - start
    return {"latencies": latencies, "ttfts": ttfts, "tokens": counted[0], "wall_s": wall}
