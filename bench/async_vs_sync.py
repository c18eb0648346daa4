"""Async vs sync GRPO on the built-in task: same model, replicas, seed and time budget.

The tiny model taught the addition task to a partial skill (rollwire.learner.teach) is
served by 2 transformers replicas (1 torch thread each) behind one proxy; `rollwire learner`
(1 torch thread) trains a LoRA adapter for a fixed wall-clock budget, once synchronously
(buffer.max_staleness = 0: on-policy batches, blocking push) and once asynchronously
(max_staleness = 1: generation overlaps training, pushes do not block). Held-out greedy
accuracy is measured at the start, every few steps and at the end. The two modes alternate
per repeat on the same replicas and proxy (each run its own adapter name), after one short
warm-up run, so drift of this shared machine hits both. Accuracy is timed at the step whose
weights were scored, from the start of training; evaluations share the replicas with
training in both modes.
Figures: groups/s trained, wall time until held-out accuracy first reaches the target, the
staleness of every trained group, final held-out accuracy.
Run: .venv/bin/python bench/async_vs_sync.py [--repeats 3] [--budget-s 25]
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import WORK, spread, start_proxy, stop_all, write_result

from rollwire.common.services import start

MODES = {"sync": 0, "async": 1}  # mode -> buffer.max_staleness
TARGET = 0.9  # held-out greedy accuracy; the taught model starts near 0.33 and the task tops out at 1.0
EVAL_EVERY, EVAL_SIZE, REPLICAS, SEED = 5, 50, 2, 0


def taught_model() -> Path:
    from rollwire.learner.teach import build_taught_model

    return build_taught_model(WORK / "taught", log=lambda line: None)


def start_stack(model: Path) -> list:
    """2 transformers replicas (1 torch thread each) and a proxy; the proxy is last."""
    with ThreadPoolExecutor(REPLICAS) as pool:
        replicas = list(pool.map(lambda i: start(
            ["generator", "--model", str(model), "--port", "0", "--metrics-port", "0", "--set", "transformers.threads=1"],
            WORK, f"grpo-generator-{i}"), range(REPLICAS)))
    return [*replicas, start_proxy(replicas, "grpo-proxy")]


def learn(target: str, model: Path, name: str, staleness: int, *settings: str) -> Path:
    """One `rollwire learner` run under adapter `name` (a fresh version line on the shared
    replicas); returns its run folder."""
    run = WORK / "grpo" / name
    if run.exists():
        shutil.rmtree(run)
    run.parent.mkdir(parents=True, exist_ok=True)
    overrides = [f"target={target}", f"base_model={model}", f"run_dir={run}", f"adapter_name={name}", f"seed={SEED}",
                 "metrics_port=0", "progress=false", f"buffer.max_staleness={staleness}", "train.threads=1",
                 f"task.eval_size={EVAL_SIZE}", f"eval.every_steps={EVAL_EVERY}", "checkpoint.every_steps=0", *settings]
    learner = start(["learner", *overrides], WORK, f"grpo-learner-{name}", timeout=300)
    try:
        code = learner.proc.wait(timeout=900)
    finally:
        learner.stop()
    if code != 0:
        raise RuntimeError(f"learner {name} exited with {code}; see {learner.log_path}")
    return run


def figures(run: Path) -> dict:
    summary = json.loads((run / "summary.json").read_text())
    steps = [json.loads(line) for line in (run / "steps.jsonl").read_text().splitlines()]
    staleness: Counter[int] = Counter()
    trained_before = 0
    for step in steps:  # max_staleness <= 1: a step's mean and group count give its exact split
        trained = step["groups"]["trained"] - trained_before
        trained_before = step["groups"]["trained"]
        assert step["staleness_max"] <= 1
        stale = round(step["staleness_mean"] * trained)
        staleness[0] += trained - stale
        staleness[1] += stale
    before = next(e for e in summary["evals"] if e["label"] == "before")
    started = before["elapsed_s"]  # training starts once the starting policy is scored
    step_time = {0: 0.0, **{s["step"]: s["elapsed_s"] - started for s in steps}}
    curve = [(step_time[e["step"]], e["accuracy"]) for e in summary["evals"]
             if e["accuracy"] is not None and e["step"] in step_time]
    phases = {k: sum(st["phase_seconds"].get(k, 0.0) for st in steps) / len(steps) for k in ("wait", "train", "push")}
    dropped = summary["groups"]["dropped"]
    scored = summary["groups"]["trained"] + sum(v for k, v in dropped.items() if k != "shutdown")
    return {
        "groups_per_s": summary["groups_per_s"],
        "scored_groups_per_s": scored / summary["training_seconds"],
        "steps": summary["steps"],
        "training_seconds": summary["training_seconds"],
        "accuracy_before": summary["accuracy_before"],
        "accuracy_after": summary["accuracy_after"],
        "seconds_to_target": next((t for t, acc in curve if acc >= TARGET), None),
        "staleness": {str(k): v for k, v in sorted(staleness.items())},
        "staleness_mean": summary["staleness_mean"],
        "dropped": dropped,
        "push_latency_s": summary["push_latency_s"],
        "step_phase_s": phases,
        "curve": [{"seconds": t, "accuracy": acc} for t, acc in curve],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=25.0, help="training seconds of each run")
    args = ap.parse_args()
    model = taught_model()
    stack = start_stack(model)
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    try:
        learn(stack[-1].target, model, "warmup", 1, "max_steps=3", "eval.at_start=false", "eval.at_end=false")
        for index in range(args.repeats):
            for mode, staleness in MODES.items():
                run = learn(stack[-1].target, model, f"{mode}-{index}", staleness, f"max_seconds={args.budget_s}")
                result = figures(run)
                runs[mode].append(result)
                print(f"{mode:5s} #{index}: {result['groups_per_s']:.2f} groups/s trained, {result['steps']} steps, "
                      f"accuracy {result['accuracy_before']:.3f} -> {result['accuracy_after']:.3f}, "
                      f"target {TARGET} after {result['seconds_to_target']} s, staleness {result['staleness']}", flush=True)
    finally:
        stop_all(reversed(stack))
    pairs = list(zip(runs["sync"], runs["async"]))
    ratios = {
        "trained groups/s async/sync": spread([a["groups_per_s"] / s["groups_per_s"] for s, a in pairs]),
        "scored groups/s async/sync": spread([a["scored_groups_per_s"] / s["scored_groups_per_s"] for s, a in pairs]),
    }
    if all(s["seconds_to_target"] and a["seconds_to_target"] for s, a in pairs):
        ratios["time to target sync/async"] = spread([s["seconds_to_target"] / a["seconds_to_target"] for s, a in pairs])
    per_mode = {mode: {k: spread([r[k] for r in rs if r[k] is not None]) if any(r[k] is not None for r in rs) else None
                       for k in ("groups_per_s", "scored_groups_per_s", "seconds_to_target", "accuracy_after", "staleness_mean")}
                for mode, rs in runs.items()}
    write_result(
        "async_vs_sync",
        ".venv/bin/python bench/async_vs_sync.py",
        {"workload": {"replicas": REPLICAS, "budget_s": args.budget_s, "seed": SEED, "target_accuracy": TARGET,
                      "eval_every_steps": EVAL_EVERY, "eval_size": EVAL_SIZE, "max_staleness": MODES},
         "per_mode": per_mode, "ratios": ratios, "runs": runs},
    )


if __name__ == "__main__":
    main()
