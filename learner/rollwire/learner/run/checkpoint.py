"""Checkpoints: what a restarted learner needs to continue where it stopped.

Layout: `DIR/step-000012/{adapter.safetensors, trainer.pt, state.json}` and `DIR/latest`,
a file naming the newest complete checkpoint.

Invariants:
- a checkpoint is written into a temporary folder, every file fsynced, the folder renamed into
  place and the parent fsynced, then `latest` is replaced atomically (temp file, fsync, rename,
  fsync of the folder): a crash or power loss at any moment leaves the previous checkpoint as latest;
- `trainer.pt` holds only tensors and plain containers (an optimiser state_dict, the torch RNG
  state) and is loaded with `weights_only=True`: a checkpoint folder cannot run code on load;
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

from rollwire.runtime.durable import atomic_dir, write_atomic, write_synced

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
    for orphan in root.glob(".step-*.tmp-*"):  # left by a save that crashed
        shutil.rmtree(orphan, ignore_errors=True)
    with atomic_dir(final) as tmp:
        write_synced(tmp / "adapter.safetensors", adapter)
        with open(tmp / "trainer.pt", "wb") as f:
            torch.save({"optimizer": optimizer_state, "torch_rng": torch.get_rng_state()}, f)
            f.flush()
            os.fsync(f.fileno())
        write_synced(tmp / "state.json", (json.dumps(asdict(state)) + "\n").encode())
    write_atomic(root / LATEST, (final.name + "\n").encode())
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
    trainer = torch.load(path / "trainer.pt", map_location="cpu", weights_only=True)
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
