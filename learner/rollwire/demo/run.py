"""`make demo`: the whole stack on this machine, learning the built-in task in a fixed budget.

Starts a generator replica (--replicas for more; --engine vllm: each backed by a vLLM server), a
proxy in front of it and the learner, each as its own process with its own log in the run
folder; shows a live progress line; ends with a table
(held-out accuracy before and after, steps, groups/s, staleness, push latency), a
reward-curve PNG and summary.json. The last line printed names the run folder;
runs/latest points to it. Ctrl-C stops every process it started, cleanly.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from datetime import datetime
from pathlib import Path

from rollwire.demo.plot import MISSING
from rollwire.demo.stack import (
    LOCAL_REPLICAS,
    VLLM_START_S,
    WHOLE_GROUPS,
    Service,
    local_placement,
    start,
    start_stack,
    vllm_replica_args,
)

SUMMARY_KEYS = (
    "accuracy_before",
    "accuracy_after",
    "steps",
    "groups_per_s",
    "staleness_mean",
    "staleness_max",
    "push_latency_s",
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rollwire.demo", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--budget-s", type=float, default=120.0, help="seconds of training (default 120)")
    p.add_argument(
        "--replicas", type=int, default=LOCAL_REPLICAS, help="generator replicas behind the proxy (default %(default)s)"
    )
    p.add_argument(
        "--engine",
        choices=("transformers", "vllm"),
        default="transformers",
        help="what backs each replica: transformers (embedded, default) or vllm (a vLLM server per replica, "
        "launched from --vllm-python; `make demo ENGINE=vllm` builds .venv-vllm first)",
    )
    p.add_argument(
        "--vllm-python",
        default=".venv-vllm/bin/python",
        help="the interpreter of vLLM's own environment, for --engine vllm (default %(default)s)",
    )
    p.add_argument("--runs-dir", default="runs", help="where run folders go (default runs/)")
    p.add_argument("--model-dir", default="runs/models/taught", help="taught model folder, built once and reused")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="learner config override, e.g. train.lr=5e-4 (repeatable)",
    )
    return p.parse_args(argv)


def _replicas(count: int) -> str:
    return f"{count} generator replica" + ("s" if count != 1 else "")


def main(argv=None) -> int:
    args = parse_args(argv)
    # Ctrl-C (even when started in the background, where SIGINT may be ignored) and SIGTERM
    # both end up in the KeyboardInterrupt path below, which stops every process it started.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    run = new_run_folder(Path(args.runs_dir))
    services: list[Service] = []
    say(
        f"rollwire demo: {_replicas(args.replicas)} ({args.engine}) behind a proxy, "
        f"{args.budget_s:.0f} s of GRPO training"
    )
    try:
        model = teach_model(Path(args.model_dir), run)
        placement = local_placement(args.replicas)
        if placement.learner:
            say(f"cores: learner {sorted(placement.learner)}, replicas and proxy {sorted(placement.replicas)}")
        engine, start_timeout = engine_args(args)
        stack = start_stack(
            model,
            run,
            args.replicas,
            generator_args=(*WHOLE_GROUPS, *engine),
            placement=placement,
            start_timeout=start_timeout,
        )
        services += stack.services
        proxy = stack.proxy
        say(f"{_replicas(args.replicas)} ready")
        say(f"proxy on {proxy.target} -> replicas {', '.join(g.target for g in stack.replicas)}")
        config = write_learner_config(run, proxy.target, model, args)
        learner = start(["learner", "--config", str(config)], run, "learner", timeout=300, cpus=placement.learner)
        services.append(learner)
        say(f"learner running (metrics on :{learner.metrics_port}); logs in {run}/")
        code = follow(learner, run / "learner", args.budget_s)
        if code != 0:
            say(f"\nthe learner exited with code {code}; the end of {learner.log_path}:")
            print(learner.log_path.read_text(errors="replace")[-3000:])
            return 1
        summary = finish(run, args)
        print_table(summary, run)
        return 0
    except KeyboardInterrupt:
        say("\ninterrupted: stopping every process")
        return 130
    finally:
        stop_all(services)
        print(f"run folder: {run}")


def engine_args(args) -> tuple[tuple[str, ...], float]:
    """The replicas' engine flags and how long one may take to start."""
    if args.engine == "transformers":
        return (), 120.0
    python = Path(args.vllm_python).absolute()  # not resolve(): a venv's python is a symlink to the base one
    if not python.is_file():
        raise SystemExit(f"--engine vllm needs vLLM's environment at {python}: run `make .venv-vllm` (~3 min)")
    say(f"vLLM-backed replicas: each starts a vLLM server from {python} (about a minute, ~3 GB each)")
    return vllm_replica_args(python), VLLM_START_S


def say(line: str) -> None:
    print(line, flush=True)


def new_run_folder(runs: Path) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    run, n = runs / stamp, 1
    while run.exists():  # two runs in the same second
        n += 1
        run = runs / f"{stamp}-{n}"
    run.mkdir(parents=True)
    latest = runs / "latest"
    if latest.is_symlink() or latest.exists():
        latest.unlink()
    latest.symlink_to(run.name)
    return run


def teach_model(folder: Path, run: Path) -> Path:
    from rollwire.demo.teach import TeachSpec, build_taught_model, cached_key, describe

    if cached_key(folder) != TeachSpec().key():
        say(f"teaching the tiny model the addition task (about a minute, once; cached in {folder})")
    live = sys.stdout.isatty()
    with (run / "teach.log").open("a") as log:

        def show(line: str) -> None:
            log.write(line + "\n")
            print(f"\r  {line}   " if live else f"  {line}", end="" if live else "\n", flush=True)

        build_taught_model(folder, log=show)
    say(f"{chr(13) if live else ''}base model: {describe(folder)}")
    return folder


def write_learner_config(run: Path, target: str, model: Path, args) -> Path:
    """The demo's learner config as TOML; `--set` overrides are validated and resolved into it."""
    import tomli_w

    from rollwire.learner.config import LearnerConfig
    from rollwire.runtime.config import dump_config, load_config

    demo = {
        "target": target,
        "base_model": str(model),
        "run_dir": str(run / "learner"),
        "metrics_port": 0,
        "max_seconds": args.budget_s,
        "progress": False,
        "train": {"threads": 1},
        "eval": {"every_steps": 15},
        "checkpoint": {"every_steps": 50},
    }
    path = run / "learner.toml"
    path.write_text(tomli_w.dumps(demo))
    if args.overrides:
        path.write_text(dump_config(load_config(LearnerConfig, path, args.overrides)))
    return path


def follow(learner: Service, run_dir: Path, budget_s: float) -> int:
    """Show a live progress line until the learner exits; returns its exit code."""
    started, last, evals, printed = time.monotonic(), {}, {}, 0.0
    steps_file, evals_file = run_dir / "steps.jsonl", run_dir / "evals.jsonl"
    live = sys.stdout.isatty()
    while learner.proc.poll() is None:
        time.sleep(0.5)
        last = _last_json(steps_file) or last
        evals = _last_json(evals_file) or evals
        now = time.monotonic()
        if last and (live or now - printed >= 10):
            line = progress_line(now - started, budget_s, last, evals)
            print("\r" + line if live else line, end="" if live else "\n", flush=True)
            printed = now
    if live:
        print()
    return learner.proc.returncode


def progress_line(elapsed: float, budget: float, step: dict, evaluation: dict) -> str:
    held = evaluation.get("accuracy")
    held_text = f"held-out {100 * held:5.1f}%" if held is not None else "held-out   n/a"
    groups = step["groups"]
    return (
        f"[{elapsed:5.0f}s/{budget:.0f}s] step {step['step']:4d} v{step['version']:<4d} "
        f"reward {_num(step.get('rollout_reward_mean'))}  sampled acc {_num(step.get('rollout_accuracy'))}  "
        f"{held_text}  "
        f"staleness {step['staleness_mean']:.2f}  ratio {step['ratio_mean']:.3f}  "
        f"trained {groups['trained']} dropped {sum(groups['dropped'].values())}   "
    )


def _num(value) -> str:
    return " n/a" if value is None else f"{value:.2f}"


def _last_json(path: Path) -> dict:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return {}
    for line in reversed(lines):
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            continue
    return {}


def finish(run: Path, args) -> dict:
    """summary.json and the reward curve from what the learner wrote."""
    from rollwire.demo.plot import Series, line_chart

    learner = json.loads((run / "learner" / "summary.json").read_text())
    steps = [json.loads(line) for line in (run / "learner" / "steps.jsonl").read_text().splitlines() if line]
    evals = [e for e in learner["evals"] if e["accuracy"] is not None]
    chart = line_chart(
        run / "reward_curve.png",
        [
            Series(
                "mean reward of rollouts",
                [s["step"] for s in steps if s.get("rollout_reward_mean") is not None],
                [s["rollout_reward_mean"] for s in steps if s.get("rollout_reward_mean") is not None],
                (31, 119, 180),
            ),
            Series(
                "held-out accuracy", [e["step"] for e in evals], [e["accuracy"] for e in evals], (255, 127, 14), True
            ),
        ],
        "GRPO on the tiny model",
        "step",
    )
    summary = {k: learner[k] for k in SUMMARY_KEYS}
    summary.update(
        budget_s=args.budget_s,
        replicas=args.replicas,
        engine=args.engine,
        reward_curve=str(chart) if chart else None,
        push_latency_max_s=learner["push_latency_max_s"],
        groups=learner["groups"],
        ratio_mean_staleness0=learner["ratio_mean_staleness0"],
        versions=[learner["first_version"], learner["last_version"]],
    )
    (run / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def print_table(s: dict, run: Path) -> None:
    def pct(v):
        return "n/a" if v is None else f"{100 * v:.1f}%"

    gain = (
        (s["accuracy_after"] - s["accuracy_before"]) * 100
        if None not in (s["accuracy_after"], s["accuracy_before"])
        else None
    )
    dropped = ", ".join(f"{k} {v}" for k, v in sorted(s["groups"]["dropped"].items())) or "none"
    rows = [
        (
            "held-out accuracy",
            f"{pct(s['accuracy_before'])} -> {pct(s['accuracy_after'])}"
            + (f"  ({gain:+.1f} points, greedy)" if gain is not None else ""),
        ),
        ("steps", f"{s['steps']}  (adapter versions {s['versions'][0]}..{s['versions'][1]})"),
        ("groups/s", f"{s['groups_per_s']:.1f}  ({s['groups']['trained']} groups trained)"),
        ("staleness", f"mean {s['staleness_mean']:.2f}, max {s['staleness_max']} (groups)" + _tokens_stale(s)),
        ("push latency", f"mean {1000 * s['push_latency_s']:.0f} ms, max {1000 * s['push_latency_max_s']:.0f} ms"),
        ("ratio at staleness 0", "n/a" if s["ratio_mean_staleness0"] is None else f"{s['ratio_mean_staleness0']:.6f}"),
        ("groups dropped", dropped),
        ("reward curve", s["reward_curve"] or f"skipped: {MISSING}"),
    ]
    print_rows(rows)


def print_rows(rows: list[tuple[str, str]]) -> None:
    """The end-of-run table: a blank line, then one `name  value` line per row."""
    say("")
    for name, value in rows:
        say(f"  {name:<22}{value}")


def stop_all(services: list[Service]) -> None:
    """One at a time, in reverse order of starting: the learner (it checkpoints and pushes its
    last version) while the proxy still serves, then the proxy, then the replicas."""
    for svc in reversed(services):
        try:
            svc.stop(timeout=30 if svc.name == "learner" else 15)
        except KeyboardInterrupt:
            svc.kill()


if __name__ == "__main__":
    sys.exit(main())


def _tokens_stale(s: dict) -> str:
    """The token-level staleness beside the group-level one (they differ when samples follow new versions)."""
    mean = s.get("token_staleness_mean")
    return "" if mean is None else f"; tokens mean {mean:.2f}, max {s.get('token_staleness_max')}"
