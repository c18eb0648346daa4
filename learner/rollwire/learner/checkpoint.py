"""Checkpoints: what a restarted learner needs to continue where it stopped.

Layout: `DIR/step-000012/{adapter.safetensors, trainer.pt, state.json}` and `DIR/latest`,
a file naming the newest complete checkpoint.

Invariants:
- a checkpoint is written into a temporary folder and renamed into place, then `latest` is
  replaced atomically: a crash at any moment leaves the previous checkpoint as latest;
- `state.version` is the version of the saved adapter. A resumed learner publishes its
  weights as `next_version(state.version, versions the target holds)`, strictly above
  everything pushed before (even pushes after the checkpoint), so replicas accept it.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

LATEST = "latest"


@dataclass
class LearnerState:
    """Counters and positions; the tensors live next to it."""

    step: int
    version: int
    data_cursor: int
    python_rng: list
    config_digest: str = ""


@dataclass
class Checkpoint:
    path: Path
    state: LearnerState
    adapter: bytes
    trainer: dict
    """{"optimizer": state_dict, "torch_rng": ByteTensor}."""


def save(directory: str | Path, state: LearnerState, adapter: bytes, optimizer_state: dict, keep: int = 2) -> Path:
    """Write one checkpoint atomically, point `latest` at it, keep the newest `keep`."""
    import torch

    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{state.step:06d}"
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    (tmp / "adapter.safetensors").write_bytes(adapter)
    torch.save({"optimizer": optimizer_state, "torch_rng": torch.get_rng_state()}, tmp / "trainer.pt")
    (tmp / "state.json").write_text(json.dumps(asdict(state)) + "\n")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _write_atomic(root / LATEST, final.name + "\n")
    for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_latest(directory: str | Path) -> Checkpoint | None:
    """The checkpoint `latest` names, or None when there is none."""
    import torch

    root = Path(directory)
    try:
        name = (root / LATEST).read_text().strip()
    except FileNotFoundError:
        return None
    path = root / name
    state = LearnerState(**json.loads((path / "state.json").read_text()))
    trainer = torch.load(path / "trainer.pt", weights_only=False)
    return Checkpoint(path, state, (path / "adapter.safetensors").read_bytes(), trainer)


def python_rng_state() -> list:
    """random's global state as JSON-friendly lists."""
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def restore_python_rng(state: list) -> None:
    version, internal, gauss = state
    random.setstate((version, tuple(internal), gauss))


def next_version(saved_version: int, target_versions: Iterable[int]) -> int:
    """The version a (re)starting learner publishes first: above everything seen before."""
    return max([saved_version, *target_versions]) + 1


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
