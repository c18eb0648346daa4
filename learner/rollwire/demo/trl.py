"""`make demo-trl`: TRL's AsyncGRPOTrainer, unmodified, learning the built-in task through rollwire.

Starts two generator replicas behind a proxy that serves its HTTP front door (vLLM's server
API, docs/http.md), then TRL 1.16's `AsyncGRPOTrainer` in a process of its own
(rollwire.demo.trl_trainer) whose only link to rollwire is `vllm_server_base_url` = that door.
TRL loads every adapter version by path (`/v1/load_lora_adapter`, under the door's
`http.adapter_root`); the proxy turns each into one rollwire push that reaches both replicas.
Shows a live progress line; ends with the same kind of report as `make demo`: held-out
accuracy before and after (greedy, through the proxy, on the held-out prompts `make demo`
scores), steps, versions, weight-sync and push latency, TRL's ratio at step 1, whether both
replicas served every version TRL loaded, a reward-curve PNG and summary.json in the run
folder (runs/latest). Ctrl-C stops every process it started.

Invariants:
- every wait has a deadline. TRL's trainer hangs silently when its rollout worker dies, so it
  runs under `--timeout-s`; past it, its process group (the trainer and the worker TRL
  spawned) is killed and the demo fails, naming the trainer's log;
- "both replicas serve every version" is observed, not assumed: while TRL trains, each
  replica's own GetStatus is polled for the versions of `trl-policy` it holds, and at the end
  every version 1..last that TRL loaded must have been seen on every replica, the last one
  still loaded there;
- it stops only what it started: the replicas, the proxy and the trainer's process group.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

import grpc

from rollwire.demo.plot import MISSING
from rollwire.demo.run import _last_json, _num, new_run_folder, print_rows, say, stop_all, teach_model
from rollwire.demo.stack import Placement, Service, Stack, local_placement, pin, start_stack
from rollwire.demo.trl_trainer import ROLLOUT, SEED, TASK, TRAIN
from rollwire.v1 import generator_pb2 as pb
from rollwire.v1 import generator_pb2_grpc

ADAPTER = "trl-policy"
"""The name TRL gives its adapter versions (`trl-policy-vN`), which the door maps to trl-policy@N."""
REPLICAS = 1
"""One replica: on the one core the serving side gets here, a second replica only splits it
(docs/benchmarks.md §12: 0.68x against 0.86x one vLLM server's steps/s, one run)."""


def trl_placement(replicas: int) -> Placement:
    """Where the demo's processes run: TRL (trainer and rollout worker) and the proxy on the
    first core, the replicas alone on the rest. TRL's trainer mostly waits (for samples, for
    its syncs), and the proxy beside the replicas took the cores they generate on: measured
    (docs/benchmarks.md §12, 2 alternating runs of 60 s) 2.45 steps/s with the proxy on TRL's
    core against 1.57 beside the replica, and a weight sync of 0.19 s against 0.45 s."""
    placement = local_placement(replicas)
    if not placement.learner:
        return placement
    return Placement(learner=placement.learner, replicas=placement.replicas, proxy=placement.learner)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rollwire.demo.trl", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--budget-s", type=float, default=90.0, help="seconds of TRL training (default %(default)s)")
    p.add_argument("--max-steps", type=int, default=1000, help="TRL optimiser steps at most (default %(default)s)")
    p.add_argument(
        "--timeout-s",
        type=float,
        default=0.0,
        help="hard limit on the trainer process, start to exit (default: budget + 180 s)",
    )
    p.add_argument("--replicas", type=int, default=REPLICAS, help="generator replicas (default %(default)s)")
    p.add_argument("--runs-dir", default="runs", help="where run folders go (default runs/)")
    p.add_argument("--model-dir", default="runs/models/taught", help="taught model folder, built once and reused")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    started = time.monotonic()
    run = new_run_folder(Path(args.runs_dir))
    services: list[Service] = []
    trainer: subprocess.Popen | None = None
    watcher: ServedVersions | None = None
    say(
        f"rollwire demo-trl: TRL's AsyncGRPOTrainer through the proxy's HTTP door, {args.replicas} replicas, "
        f"{args.budget_s:.0f} s of training"
    )
    try:
        model = teach_model(Path(args.model_dir), run).resolve()
        out = run / "trl"
        lora_root = out / ".vllm_lora"  # where TRL saves each version: AsyncGRPOTrainer._lora_dir
        lora_root.mkdir(parents=True)
        placement = trl_placement(args.replicas)
        if placement.learner:
            say(f"cores: TRL and the proxy {sorted(placement.learner)}, replicas {sorted(placement.replicas)}")
        stack = start_door_stack(model, run, args.replicas, lora_root, placement)
        services += stack.services
        url = stack.proxy.http_url
        say(
            f"proxy on {stack.proxy.target} (gRPC) and {url} (HTTP) -> replicas {', '.join(r.target for r in stack.replicas)}"
        )
        before = held_out_accuracy(stack.proxy.target, None)
        say(f"held-out accuracy of the base model: {pct(before)}")
        watcher = ServedVersions(stack.replicas, ADAPTER)
        watcher.start()
        trainer = start_trainer(run, out, url, model, args.budget_s, args.max_steps, placement.learner)
        say(f"TRL trainer running (pid {trainer.pid}); its log: {run / 'trainer.log'}")
        timeout = args.timeout_s or args.budget_s + 180
        code = follow(trainer, out / "steps.jsonl", args.budget_s, timeout)
        if code == 0:  # a load answers once spooled: the relay to the replicas may still be finishing
            watcher.wait_for(json.loads((out / "summary.json").read_text())["last_version"], 30)
        watcher.stop()  # polls once more first: the last version TRL loaded
        if code != 0:
            reason = "was killed after its time limit" if code is None else f"exited with code {code}"
            say(f"\nthe TRL trainer {reason}; the end of {run / 'trainer.log'}:")
            print((run / "trainer.log").read_text(errors="replace")[-3000:])
            return 1
        trained = json.loads((out / "summary.json").read_text())
        after = held_out_accuracy(stack.proxy.target, f"{ADAPTER}@{trained['last_version']}")
        served = watcher.report(trained["last_version"])
        summary = finish(run, out, args, before, after, trained, served, stack, time.monotonic() - started)
        print_table(summary)
        return 0 if summary["every_version_on_every_replica"] else 1
    except KeyboardInterrupt:
        say("\ninterrupted: stopping every process")
        return 130
    finally:
        if trainer is not None:
            stop_trainer(trainer)
        if watcher is not None:
            watcher.stop()
        stop_all(services)
        print(f"run folder: {run}")


def door_args(lora_root: Path, model: Path, *settings: str) -> tuple[str, ...]:
    """The proxy flags of the door TRL talks to: HTTP on a free port, TRL's adapter folder
    (`<output_dir>/.vllm_lora`) the only root a load may read, the model's path a name of the
    base model (TRL names it so); `settings` are more `--set key=value` strings."""
    door = ("http.port=0", f"http.adapter_root={lora_root}", f"http.model_path={model}", *settings)
    return tuple(a for setting in door for a in ("--set", setting))


def start_door_stack(
    model: Path,
    workdir: Path,
    replicas: int,
    lora_root: Path,
    placement: Placement,
    *proxy_settings: str,
    generator_args: Sequence[str] = (),
    start_timeout: float = 120,
) -> Stack:
    """`replicas` replicas (with `generator_args`: e.g. vllm_replica_args) behind a proxy
    serving its HTTP door (`door_args`), on the cores `placement` gives them; returned once the
    proxy routes to every replica and the door answers /health, the whole stack stopped if
    either does not come."""
    stack = start_stack(
        model,
        workdir,
        replicas,
        generator_args=generator_args,
        proxy_args=door_args(lora_root, model, *proxy_settings),
        placement=placement,
        routable_timeout=60,
        start_timeout=start_timeout,
    )
    try:
        wait_healthy(stack.proxy.http_url, timeout=30)
    except BaseException:
        stack.stop()
        raise
    return stack


def wait_healthy(url: str, timeout: float) -> None:
    """Wait until the door answers GET /health with 200; TimeoutError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the proxy's HTTP door at {url} did not answer /health within {timeout:g}s")
        time.sleep(0.1)


def held_out_accuracy(target: str, adapter: str | None) -> float | None:
    """Greedy accuracy on the held-out prompts `make demo` scores, through the proxy (gRPC)."""
    from rollwire.client import AsyncClient
    from rollwire.learner.tasks.evaluate import held_out_accuracy as score
    from rollwire.learner.tasks.task import addition_examples, eval_subset

    _train, held = addition_examples(TASK.held_out_fraction)
    examples = eval_subset(held, TASK.eval_size, SEED)

    async def run() -> float | None:
        async with AsyncClient(target, timeout=60) as client:
            return (await score(client, examples, adapter, ROLLOUT.max_new_tokens)).accuracy

    return asyncio.run(run())


def start_trainer(
    run: Path,
    out: Path,
    url: str,
    model: Path,
    budget_s: float,
    max_steps: int,
    cpus: Collection[int] = (),
    seed: int | None = None,
    trainer_args: Sequence[str] = (),
) -> subprocess.Popen:
    """rollwire.demo.trl_trainer in a session of its own (so its rollout worker can be stopped with
    it) on `cpus` (empty: anywhere), one torch thread per process, logging to run/trainer.log;
    `seed` (default: the learner's) orders the data and seeds TRL; `trainer_args` are more of
    its flags (the shape: --num-generations, --batch-size, ...)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", TRL_EXPERIMENTAL_SILENCE="1")
    cmd = [
        sys.executable, "-m", "rollwire.demo.trl_trainer", "--url", url, "--model", str(model), "--out", str(out),
        "--budget-s", f"{budget_s:g}", "--max-steps", str(max_steps), "--seed", str(SEED if seed is None else seed),
        *trainer_args,
    ]  # fmt: skip
    with (run / "trainer.log").open("ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    pin(proc.pid, cpus)
    return proc


def stop_trainer(proc: subprocess.Popen, grace_s: float = 15) -> None:
    """SIGTERM to the trainer's process group (the trainer and the worker TRL spawned), SIGKILL after grace_s."""
    if proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def follow(
    proc: subprocess.Popen,
    steps_file: Path,
    budget_s: float,
    timeout_s: float,
    *,
    progress: bool = True,
    on_step: Callable[[dict], None] | None = None,
    interval_s: float = 0.5,
) -> int | None:
    """A live progress line (unless not `progress`) until the trainer exits; its exit code, or
    None when it ran past `timeout_s` (it is then killed with its worker). `on_step` is called
    with the newest line of steps_file each time it changes (checked every `interval_s`)."""
    deadline, started, printed = time.monotonic() + timeout_s, time.monotonic(), 0.0
    live = progress and sys.stdout.isatty()
    seen: int | None = None
    while proc.poll() is None:
        if time.monotonic() > deadline:
            stop_trainer(proc, grace_s=5)
            return None
        time.sleep(interval_s)
        last, now = _last_json(steps_file), time.monotonic()
        if last and on_step is not None and last.get("step") != seen:
            seen = last.get("step")
            on_step(last)
        if last and progress and (live or now - printed >= 10):
            line = (
                f"[{now - started:5.0f}s] step {last['step']:4d} v{last.get('version') or 0:<4d} "
                f"reward {_num(last.get('reward'))}  ratio {_num(last.get('ratio'))}  "
                f"staleness {_num(last.get('sample/staleness_mean'))}  weight sync {_num(last.get('perf/weight_sync_s'))} s"
                f"  (training {last['elapsed_s']:.0f}s/{budget_s:.0f}s)   "
            )
            print("\r" + line if live else line, end="" if live else "\n", flush=True)
            printed = now
    if live:
        print()
    return proc.returncode


class ServedVersions:
    """Polls each replica's own GetStatus for the versions of one adapter it holds, in a thread,
    until stopped; every wait has a deadline (2 s a call)."""

    def __init__(self, replicas: list[Service], adapter: str, interval_s: float = 0.2) -> None:
        self.replicas, self.adapter, self.interval_s = replicas, adapter, interval_s
        self.seen: dict[str, set[int]] = {r.target: set() for r in replicas}
        self.now: dict[str, list[int]] = {r.target: [] for r in replicas}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="served-versions", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wait_for(self, version: int, timeout_s: float) -> None:
        """Until every replica was seen holding `version`, or `timeout_s` passed."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not all(version in now for now in self.now.values()):
            time.sleep(self.interval_s)

    def stop(self) -> None:
        """Stop polling (after one last poll); idempotent."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)

    def poll(self, stubs: dict[str, generator_pb2_grpc.GeneratorServiceStub]) -> None:
        for target, stub in stubs.items():
            try:
                status = stub.GetStatus(pb.GetStatusRequest(), timeout=2)
            except grpc.RpcError:
                continue
            versions = [v for a in status.adapters if a.name == self.adapter for v in a.versions]
            self.now[target] = versions
            self.seen[target].update(versions)

    def _run(self) -> None:
        channels = {r.target: grpc.insecure_channel(r.target) for r in self.replicas}
        stubs = {t: generator_pb2_grpc.GeneratorServiceStub(c) for t, c in channels.items()}
        try:
            while not self._stop.wait(self.interval_s):
                self.poll(stubs)
            self.poll(stubs)  # once more: the last version TRL loaded
        finally:
            for channel in channels.values():
                channel.close()

    def report(self, last_version: int) -> dict[str, dict]:
        """Per replica: versions 1..last_version never seen on it, and whether it holds the last now."""
        wanted = set(range(1, last_version + 1))
        return {
            target: {
                "missed": sorted(wanted - self.seen[target]),
                "holds_last": last_version in self.now[target],
                "loaded_now": self.now[target],
            }
            for target in self.seen
        }


def proxy_figures(proxy: Service) -> dict:
    """From the proxy's /metrics: the mean seconds from a push's manifest to its version committed
    on every replica and how many pushes (rollwire_proxy_push_fanout_duration_seconds), and per
    HTTP route of the door its requests, their mean seconds and the answers that were not 200."""
    sums: dict[str, float] = {}
    routes: dict[str, dict] = {}
    for line in proxy.metrics().splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, _, value = line.rpartition(" ")
        labels = dict(part.split("=", 1) for part in name.partition("{")[2].rstrip("}").split(",") if "=" in part)
        labels = {k: v.strip('"') for k, v in labels.items()}
        metric = name.partition("{")[0]
        if metric.startswith("rollwire_proxy_push_fanout_duration_seconds_"):
            sums[metric.rpartition("_")[2]] = float(value)
        elif metric == "rollwire_proxy_http_requests_total" and float(value):
            route = routes.setdefault(labels.get("route", "?"), {"requests": 0, "not_200": {}, "mean_s": None})
            route["requests"] += int(float(value))
            if labels.get("code") != "200":
                route["not_200"][labels.get("code", "?")] = int(float(value))
        elif metric == "rollwire_proxy_http_request_duration_seconds_sum":
            sums[f"http:{labels.get('route', '?')}"] = float(value)
    for route, figures in routes.items():
        if figures["requests"] and f"http:{route}" in sums:
            figures["mean_s"] = sums[f"http:{route}"] / figures["requests"]
    pushes = int(sums.get("count", 0))
    return {"push_fanout_s": sums["sum"] / pushes if pushes else None, "pushes": pushes, "http": routes}


def finish(run: Path, out: Path, args, before, after, trained: dict, served: dict, stack, wall_s: float) -> dict:
    """summary.json and the reward curve from what the trainer wrote."""
    from rollwire.demo.plot import Series, line_chart

    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines() if line]
    syncs = [s["perf/weight_sync_s"] for s in steps if s.get("perf/weight_sync_s") is not None]
    rewarded = [s for s in steps if s.get("reward") is not None]
    last_step = trained["steps"]
    chart = line_chart(
        run / "reward_curve.png",
        [
            Series(
                "mean reward of rollouts",
                [s["step"] for s in rewarded],
                [s["reward"] for s in rewarded],
                (31, 119, 180),
            ),
            Series(
                "held-out accuracy",
                [x for x, a in ((0, before), (last_step, after)) if a is not None],
                [a for a in (before, after) if a is not None],
                (255, 127, 14),
                True,
            ),
        ],
        "TRL AsyncGRPOTrainer through rollwire's HTTP door",
        "step",
    )
    proxy = proxy_figures(stack.proxy)
    summary = {
        "accuracy_before": before,
        "accuracy_after": after,
        "steps": last_step,
        "versions": [1, trained["last_version"]],
        "train_s": trained["train_s"],
        "wall_s": round(wall_s, 1),
        "groups_per_s": round(last_step * TRAIN.groups_per_step / trained["train_s"], 2)
        if trained["train_s"]
        else None,
        "ratio_step1": steps[0].get("ratio") if steps else None,
        "weight_sync_s": sum(syncs) / len(syncs) if syncs else None,
        "weight_sync_max_s": max(syncs) if syncs else None,
        **proxy,
        "replicas": served,
        "every_version_on_every_replica": all(not r["missed"] and r["holds_last"] for r in served.values()),
        "budget_s": args.budget_s,
        "reward_curve": str(chart) if chart else None,
    }
    (run / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


DOOR_ROUTES = ("/v1/load_lora_adapter", "/v1/completions")
"""The door's routes the report shows: TRL's adapter loads (one push each) and its rollouts."""


def door_line(routes: dict) -> str:
    """`route: requests (mean ms)` for TRL's loads and rollouts, and any answer that was not 200."""
    parts = [
        f"{route} {r['requests']}" + (f" ({1000 * r['mean_s']:.0f} ms)" if r["mean_s"] is not None else "")
        for route, r in ((route, routes.get(route)) for route in DOOR_ROUTES)
        if r
    ]
    errors = {f"{route} {code}": n for route, r in routes.items() for code, n in r["not_200"].items()}
    return ", ".join(parts) + (
        "; not 200: " + ", ".join(f"{k} x{n}" for k, n in errors.items()) if errors else "; all 200"
    )


def pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def print_table(s: dict) -> None:
    before, after = s["accuracy_before"], s["accuracy_after"]
    gain = f"  ({(after - before) * 100:+.1f} points, greedy)" if None not in (before, after) else ""
    replicas = "; ".join(
        f"{target}: " + ("all" if not r["missed"] else f"missed {r['missed']}") + f", now {r['loaded_now']}"
        for target, r in s["replicas"].items()
    )
    print_rows(
        [
            ("held-out accuracy", f"{pct(before)} -> {pct(after)}{gain}"),
            ("steps", f"{s['steps']}  (TRL loaded adapter versions {s['versions'][0]}..{s['versions'][1]})"),
            ("groups/s", f"{s['groups_per_s']}  ({s['train_s']:.0f} s of training)"),
            (
                "weight sync (TRL)",
                "n/a"
                if s["weight_sync_s"] is None
                else f"mean {1000 * s['weight_sync_s']:.0f} ms, max {1000 * s['weight_sync_max_s']:.0f} ms "
                "(save, then load through the door; its pause and resume are no-ops)",
            ),
            (
                "push to replicas",
                "n/a" if s["push_fanout_s"] is None else f"mean {1000 * s['push_fanout_s']:.0f} ms over {s['pushes']}",
            ),
            ("HTTP door", door_line(s["http"])),
            ("ratio at step 1", "n/a" if s["ratio_step1"] is None else f"{s['ratio_step1']:.6f}"),
            (
                "every version served",
                ("yes, on every replica" if s["every_version_on_every_replica"] else "NO") + f"  ({replicas})",
            ),
            ("wall time", f"{s['wall_s']:.0f} s"),
            ("reward curve", s["reward_curve"] or f"skipped: {MISSING}"),
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
