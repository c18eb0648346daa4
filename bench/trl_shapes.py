"""TRL's AsyncGRPOTrainer through rollwire vs one vLLM server, over the shapes TRL users run.

The same runs as bench/trl_vllm_vs_rollwire.py (TRL 1.16 unmodified, its defaults otherwise:
max_staleness 4, LoRA synced by path; the server sides at their defaults; the last version TRL
loaded scored by one transformers replica on `make demo`'s held-out prompts), repeated per
cell of a matrix of TRL's shape and rollwire's layout:
  g  num_generations            {4, 8}      (TRL's default: 8)
  b  per_device_train_batch_size {8, 16}    (completions per step)
  l  max_completion_length       {8, 32}
  gc gradient checkpointing      {on, off}  (TRL's default: on)
  r  rollwire's replicas          {1, 2}
  p  where rollwire's proxy runs  {serving: on the serving core beside the replicas,
                                  trl: on TRL's core (make demo-trl's placement)}
A cell is named like `g4.b8.l8.gc.r1.serving` (`nogc` for checkpointing off). In each cell the
two arms (vllm, rollwire) alternate per repeat, the order reversed every other repeat; TRL on
the first core, the server side on the other (vLLM's server always there).
Figures per run and arm: steps/s, TRL's weight sync per step, its rollout wait per step, the
share of generated samples it dropped as stale, the staleness it trained on, held-out accuracy after.
Run: .venv/bin/python bench/trl_shapes.py [--cells all|CELL,CELL,...] [--repeats 3] [--budget-s 20] [--fresh]
(needs `make .venv-vllm`; the whole matrix is 64 cells, about 6 minutes a cell at the defaults). The
matrix is long, so a run adds its cells to those bench/results/trl_shapes.json holds (each cell keeps
the date and command that measured it; a cell measured again is replaced); --fresh starts over.
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import dataclass

from common import RESULTS, ROOT, WORK, machine, spread, write_result
from trl_vllm_vs_rollwire import TAUGHT, TRL_MAX_STALENESS, run_arm

from rollwire.demo.stack import ONE_THREAD, start_generators, stop_all
from rollwire.demo.teach import build_taught_model
from rollwire.demo.trl import held_out_accuracy

FIGURES = (
    "steps_per_s",
    "weight_sync_s",
    "rollout_wait_s",
    "dropped_stale_share",
    "staleness_mean",
    "accuracy_after",
)


@dataclass(frozen=True)
class Cell:
    generations: int
    batch: int
    length: int
    checkpointing: bool
    replicas: int
    proxy: str  # "serving" | "trl"

    @property
    def name(self) -> str:
        gc = "gc" if self.checkpointing else "nogc"
        return f"g{self.generations}.b{self.batch}.l{self.length}.{gc}.r{self.replicas}.{self.proxy}"

    @classmethod
    def parse(cls, name: str) -> Cell:
        try:
            g, b, length, gc, r, proxy = name.split(".")
            cell = cls(int(g[1:]), int(b[1:]), int(length[1:]), gc == "gc", int(r[1:]), proxy)
        except ValueError:
            raise SystemExit(f"a cell is named like g4.b8.l8.gc.r1.serving, not {name!r}") from None
        if gc not in ("gc", "nogc") or proxy not in ("serving", "trl") or cell.batch % cell.generations:
            raise SystemExit(f"{name!r}: gc|nogc, serving|trl, and a batch of whole groups")
        return cell

    def trainer_args(self) -> tuple[str, ...]:
        return (
            "--num-generations", str(self.generations), "--batch-size", str(self.batch),
            "--max-completion-length", str(self.length),
            "--gradient-checkpointing" if self.checkpointing else "--no-gradient-checkpointing",
        )  # fmt: skip

    def rollwire_arm(self) -> str:
        return "rollwire-beside" if self.proxy == "serving" else "rollwire"


def all_cells() -> list[Cell]:
    return [
        Cell(g, b, length, gc, r, p)
        for g, b, length, gc, r, p in itertools.product(
            (4, 8), (8, 16), (8, 32), (True, False), (1, 2), ("serving", "trl")
        )
    ]


def run_cell(cell: Cell, repeats: int, budget_s: float, model, scorer) -> dict:
    arms = {"vllm": "vllm", "rollwire": cell.rollwire_arm()}
    runs: dict[str, list[dict]] = {a: [] for a in arms}
    for r in range(repeats):
        for arm in list(arms) if r % 2 == 0 else list(reversed(arms)):
            replicas = cell.replicas if arm == "rollwire" else None
            result = run_arm(
                arms[arm], r + 1, model, budget_s, scorer,
                tag=f"{cell.name}-", trainer_args=cell.trainer_args(), replicas=replicas,
            )  # fmt: skip
            runs[arm].append(result)
            print(f"{cell.name} repeat {r + 1} {arm}: " + ", ".join(f"{k} {result[k]}" for k in FIGURES), flush=True)
    over = {
        k: _spread(
            [
                w[k] / v[k] if w[k] is not None and v[k] else None
                for w, v in zip(runs["rollwire"], runs["vllm"], strict=True)
            ]
        )
        for k in FIGURES
    }
    return {
        "per_arm": {arm: {k: _spread([x[k] for x in rs]) for k in FIGURES} for arm, rs in runs.items()},
        "rollwire_over_vllm": over,
        "runs": runs,
    }


def measured_before() -> dict[str, dict]:
    """The cells of the last results file, each with the date and command that measured it."""
    path = RESULTS / "trl_shapes.json"
    if not path.is_file():
        return {}
    old = json.loads(path.read_text())
    return {
        name: {"measured": old["machine"]["date"], "command": old["command"]} | cell
        for name, cell in old.get("cells", {}).items()
    }


def _spread(values: list) -> dict | None:
    known = [v for v in values if v is not None]
    return spread(known) if known else None


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--cells", default="all", help="all, or comma-separated cell names (g4.b8.l8.gc.r1.serving)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=20.0)
    p.add_argument("--fresh", action="store_true", help="forget the cells measured before")
    args = p.parse_args()
    cells = all_cells() if args.cells == "all" else [Cell.parse(c) for c in args.cells.split(",") if c]
    if not (ROOT / ".venv-vllm" / "bin" / "python").is_file():
        raise SystemExit("run `make .venv-vllm` first")
    model = build_taught_model(TAUGHT, log=lambda line: None).resolve()
    (scorer,) = start_generators(model, WORK, ["trl-scorer"], *ONE_THREAD, "--set", "adapter_keep=512")
    results = {} if args.fresh else measured_before()
    command = f"python bench/trl_shapes.py --cells {args.cells} --repeats {args.repeats} --budget-s {args.budget_s:g}"
    try:
        before = held_out_accuracy(scorer.target, None)
        for cell in cells:
            results[cell.name] = run_cell(cell, args.repeats, args.budget_s, model, scorer) | {
                "measured": machine()["date"],
                "command": command,
            }
            write_result(  # after every cell: a long matrix keeps what it measured
                "trl_shapes",
                command,
                {
                    "workload": {
                        "budget_s": args.budget_s,
                        "repeats": args.repeats,
                        "accuracy_before": before,
                        "max_staleness": TRL_MAX_STALENESS,
                    },
                    "cells": results,
                },
            )
    finally:
        stop_all([scorer])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
