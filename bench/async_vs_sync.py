"""Async vs sync GRPO on the built-in task: same model, replicas, seed and time budget.

The tiny model taught the addition task to a partial skill (rollwire.demo.teach) is
served by 2 transformers replicas (1 torch thread each) behind one proxy; `rollwire learner`
(1 torch thread) trains a LoRA adapter for a fixed wall-clock budget, once synchronously
(buffer.max_staleness = 0: on-policy batches, blocking push) and once asynchronously
(max_staleness = 1: generation overlaps training, pushes do not block). Held-out greedy
accuracy is measured by the learner at the start and at the end, and in between by this
script (`Watcher`) on the newest version the learner reports served, twice a second at most. The two modes alternate
per repeat on the same replicas and proxy (each run its own adapter name), after one short
warm-up run, so drift of this shared machine hits both. Accuracy is timed at the step whose
weights were scored, from the start of training; evaluations share the replicas with
training in both modes.
Figures: groups/s trained, wall time until held-out accuracy first reaches the target, the
staleness of every trained group, final held-out accuracy.
Run: .venv/bin/python bench/async_vs_sync.py [--repeats 5] [--budget-s 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import threading
import time
from collections import Counter
from collections.abc import Collection, Sequence
from pathlib import Path

from common import WORK, spread, stop_all, write_result

from rollwire.demo.stack import Placement, start
from rollwire.demo.stack import start_stack as start_local_stack

MODES = {"sync": 0, "async": 1}  # mode -> buffer.max_staleness
TARGET = 0.9  # held-out greedy accuracy; the taught model starts near 0.33 and the task tops out at 1.0
EVAL_INTERVAL_S, EVAL_SIZE, REPLICAS, SEED = 0.5, 50, 2, 0
NO_REPLICA_WAIT_S = 1.0  # see start_stack


def taught_model() -> Path:
    from rollwire.demo.teach import build_taught_model

    return build_taught_model(WORK / "taught", log=lambda line: None)


def start_stack(
    model: Path,
    *proxy_settings: str,
    replicas: int = REPLICAS,
    generator_args: Sequence[str] = (),
    placement: Placement = Placement(),
) -> list:
    """`replicas` transformers replicas (1 torch thread each, `generator_args` added) and a
    proxy (extra `--set` strings in `proxy_settings`), on the cores `placement` gives them;
    the proxy is last.

    In async mode a version being scored can leave the replicas' window of 3 (default) as
    newer ones arrive; the proxy holds requests for a version no replica has for
    no_replica_wait_s (default 10 s) before refusing them, which would stall the Watcher, so
    here it refuses after 1 s (refusals are counted). A wider window would avoid refusals,
    but it makes every adapter load on the transformers engine slower, so both modes would
    be measured on a slower engine than the default one."""
    settings = (f"routing.no_replica_wait_s={NO_REPLICA_WAIT_S}", *proxy_settings)
    proxy_args = [a for s in settings for a in ("--set", s)]
    stack = start_local_stack(
        model,
        WORK,
        replicas,
        generator_args=generator_args,
        proxy_args=proxy_args,
        prefix="grpo-",
        routable_timeout=60,
        placement=placement,
    )
    return stack.services


def learn(
    target: str, model: Path, name: str, staleness: int, *settings: str, watch: bool = True, cpus: Collection[int] = ()
) -> tuple[Path, dict[int, dict]]:
    """One `rollwire learner` run under adapter `name` (a fresh version line on the shared
    replicas), on `cpus` (empty: anywhere), scored by a `Watcher` meanwhile unless `watch` is
    False (then no scores); returns its run folder and the scores."""
    run = WORK / "grpo" / name
    if run.exists():
        shutil.rmtree(run)
    run.parent.mkdir(parents=True, exist_ok=True)
    overrides = [
        f"target={target}",
        f"base_model={model}",
        f"run_dir={run}",
        f"adapter_name={name}",
        f"seed={SEED}",
        "metrics_port=0",
        "progress=false",
        f"buffer.max_staleness={staleness}",
        "train.threads=1",
        f"task.eval_size={EVAL_SIZE}",
        "eval.every_steps=0",
        "checkpoint.every_steps=0",
        *settings,
    ]
    learner = start(["learner", *overrides], WORK, f"grpo-learner-{name}", timeout=300, cpus=cpus)
    watcher = Watcher(target, name, run / "steps.jsonl") if watch else None
    try:
        code = learner.proc.wait(timeout=900)
    finally:
        learner.stop()
        scores = watcher.stop() if watcher else {}
    if code != 0:
        raise RuntimeError(f"learner {name} exited with {code}; see {learner.log_path}")
    return run, scores


class Watcher:
    """Scores the newest served adapter version on the held-out prompts while a learner runs.

    The learner's own periodic evaluation scores the version it just trained, which in async
    mode is not served yet; this scores only versions the learner reports as served (its
    steps.jsonl), at most every EVAL_INTERVAL_S, with the learner's own prompts and scoring.
    """

    def __init__(self, target: str, name: str, steps: Path) -> None:
        self.target, self.name, self.steps = target, name, steps
        self.scores: dict[int, dict] = {}
        self.done = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._watch()), daemon=True)
        self.thread.start()

    def stop(self) -> dict[int, dict]:
        self.done.set()
        self.thread.join(60)
        return self.scores

    def _served(self) -> int:
        try:
            lines = self.steps.read_text().splitlines()
        except FileNotFoundError:
            return 0
        return json.loads(lines[-1])["served"] if lines else 0

    async def _watch(self) -> None:
        from rollwire.client import AsyncClient
        from rollwire.learner.tasks.evaluate import held_out_accuracy
        from rollwire.learner.tasks.task import addition_examples, eval_subset

        examples = eval_subset(addition_examples(0.1)[1], EVAL_SIZE, SEED)  # the learner's defaults
        async with AsyncClient(self.target, timeout=60, max_attempts=1) as client:
            while not self.done.is_set():
                started, version = time.monotonic(), self._served()
                if version and version not in self.scores:
                    result = await held_out_accuracy(client, examples, f"{self.name}@{version}", 8)
                    self.scores[version] = {
                        "accuracy": result.accuracy,
                        "answered": result.answered,
                        "failed": result.failed,
                    }
                await asyncio.sleep(max(0.05, EVAL_INTERVAL_S - (time.monotonic() - started)))


def figures(run: Path, scores: dict[int, dict]) -> dict:
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
    produced = {before["version"]: 0.0, **{s["version"]: s["elapsed_s"] - started for s in steps}}
    curve = [(0.0, before["accuracy"])] + [
        (produced[v], sc["accuracy"])
        for v, sc in sorted(scores.items())
        if sc["accuracy"] is not None and v in produced and v != before["version"]
    ]
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
        "scored_versions": len(scores),
        "eval_requests_failed": sum(sc["failed"] for sc in scores.values()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=20.0, help="training seconds of each run")
    args = ap.parse_args()
    from rollwire.runtime.logs import setup_logging

    setup_logging("bench", "error")  # refused evaluation requests are counted, not printed
    model = taught_model()
    stack = start_stack(model)
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    try:
        learn(stack[-1].target, model, "warmup", 1, "max_steps=3", "eval.at_end=false")
        for index in range(args.repeats):
            for mode, staleness in MODES.items():
                run, scores = learn(
                    stack[-1].target, model, f"{mode}-{index}", staleness, f"max_seconds={args.budget_s}"
                )
                result = figures(run, scores)
                runs[mode].append(result)
                print(
                    f"{mode:5s} #{index}: {result['groups_per_s']:.2f} groups/s trained, {result['steps']} steps, "
                    f"accuracy {result['accuracy_before']:.3f} -> {result['accuracy_after']:.3f}, "
                    f"target {TARGET} after {result['seconds_to_target']} s, staleness {result['staleness']}",
                    flush=True,
                )
    finally:
        stop_all(reversed(stack))
    pairs = list(zip(runs["sync"], runs["async"], strict=False))
    ratios = {
        "trained groups/s async/sync": spread([a["groups_per_s"] / s["groups_per_s"] for s, a in pairs]),
        "scored groups/s async/sync": spread([a["scored_groups_per_s"] / s["scored_groups_per_s"] for s, a in pairs]),
    }
    if all(s["seconds_to_target"] and a["seconds_to_target"] for s, a in pairs):
        ratios["time to target sync/async"] = spread(
            [s["seconds_to_target"] / a["seconds_to_target"] for s, a in pairs]
        )
    per_mode = {
        mode: {
            k: spread([r[k] for r in rs if r[k] is not None]) if any(r[k] is not None for r in rs) else None
            for k in ("groups_per_s", "scored_groups_per_s", "seconds_to_target", "accuracy_after", "staleness_mean")
        }
        for mode, rs in runs.items()
    }
    write_result(
        "async_vs_sync",
        ".venv/bin/python bench/async_vs_sync.py",
        {
            "workload": {
                "replicas": REPLICAS,
                "budget_s": args.budget_s,
                "seed": SEED,
                "target_accuracy": TARGET,
                "eval_interval_s": EVAL_INTERVAL_S,
                "eval_size": EVAL_SIZE,
                "max_staleness": MODES,
            },
            "per_mode": per_mode,
            "ratios": ratios,
            "runs": runs,
        },
    )


if __name__ == "__main__":
    main()
