"""Shared pieces of the benchmarks: the tiny model, results files, repeat statistics.

Every benchmark writes bench/results/<name>.json with the machine, the date, the command
that reproduces it and, for each figure, min/median/max over its repeats.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
WORK = ROOT / "runs" / "bench"


def tiny_model() -> Path:
    """The untrained tiny model (the engines' cost does not depend on what it learned)."""
    from rollwire.learner.tiny_model import build_tiny_model

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
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
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
