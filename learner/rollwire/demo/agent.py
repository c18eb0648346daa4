"""`make demo-agent`: a multi-turn task learned from an external producer's episodes.

Starts two generator replicas behind a proxy, a learner that trains only on ingested
trajectories (task.kind = "chain", ingest.exclusive) and examples/agent_producer.py, which
plays chained-addition episodes through the proxy and submits them, scored, to the learner's
LearnerService. Each runs as its own process with its own log in the run folder. Ends with
`make demo`'s table (held-out episode success before and after, greedy), plus what the
producer submitted and the learner accepted; summary.json and the reward curve in the run
folder, which the last line names (runs/latest points to it).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from rollwire.demo.run import finish, follow, new_run_folder, print_rows, print_table, say, stop_all
from rollwire.demo.stack import WHOLE_GROUPS, Service, local_placement, pin, start, start_stack

PRODUCER = Path(__file__).resolve().parents[3] / "examples" / "agent_producer.py"
REPLICAS = 2


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rollwire.demo.agent", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--budget-s", type=float, default=80.0, help="seconds of training (default %(default)s)")
    p.add_argument("--max-steps", type=int, default=0, help="stop the learner after this many steps (0: no limit)")
    p.add_argument("--eval-size", type=int, default=200, help="held-out episodes scored (default %(default)s)")
    p.add_argument("--eval-every", type=int, default=25, help="also score every this many steps (0: never)")
    p.add_argument("--concurrency", type=int, default=6, help="groups the producer plays at once")
    p.add_argument("--runs-dir", default="runs", help="where run folders go (default runs/)")
    p.add_argument("--model-dir", default="runs/models/taught-chain", help="taught model folder, built once")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    run = new_run_folder(Path(args.runs_dir))
    services: list[Service] = []
    producer: subprocess.Popen | None = None
    say(
        f"rollwire agent demo: {REPLICAS} replicas behind a proxy, a learner ingesting multi-turn episodes "
        f"from examples/agent_producer.py, {args.budget_s:.0f} s of training"
    )
    try:
        model = teach_chain_model(Path(args.model_dir), run)
        placement = local_placement(REPLICAS)
        stack = start_stack(model, run, REPLICAS, generator_args=WHOLE_GROUPS, placement=placement)
        services += stack.services
        say(f"proxy on {stack.proxy.target} -> replicas {', '.join(g.target for g in stack.replicas)}")
        config = write_learner_config(run, stack.proxy.target, model, args)
        learner = start(["learner", "--config", str(config)], run, "learner", timeout=300, cpus=placement.learner)
        services.append(learner)
        say(f"learner ingesting on {learner.target} (metrics on :{learner.metrics_port}); logs in {run}/")
        producer = start_producer(run, stack.proxy.target, learner.target, model, args, placement.replicas)
        code = follow(learner, run / "learner", args.budget_s)
        produced = stop_producer(producer, run)
        serving = serving_counts(stack.proxy, stack.replicas)
        if code != 0:
            say(f"\nthe learner exited with code {code}; the end of {learner.log_path}:")
            print(learner.log_path.read_text(errors="replace")[-3000:])
            return 1
        summary = finish(run, argparse.Namespace(budget_s=args.budget_s, replicas=REPLICAS, engine="transformers"))
        summary.update(task="chain", producer=produced, ingest=learner_ingest(run), serving=serving)
        (run / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        print_table(summary, run)
        print_rows(ingest_rows(summary))
        return 0
    except KeyboardInterrupt:
        say("\ninterrupted: stopping every process")
        return 130
    finally:
        if producer is not None and producer.poll() is None:
            producer.kill()
            producer.wait()
        stop_all(services)
        print(f"run folder: {run}")


def teach_chain_model(folder: Path, run: Path) -> Path:
    from rollwire.demo.teach import build_taught_model, cached_key, describe
    from rollwire.demo.teach_chain import CHAIN_SPEC

    if cached_key(folder) != CHAIN_SPEC.key():
        say(f"teaching the tiny model chained addition (about two minutes, once; cached in {folder})")
    with (run / "teach.log").open("a") as log:

        def show(line: str) -> None:
            log.write(line + "\n")
            say(f"  {line}")

        build_taught_model(folder, CHAIN_SPEC, log=show)
    say(f"base model: {describe(folder)} (its accuracy: held-out episodes with every turn right)")
    return folder


def write_learner_config(run: Path, target: str, model: Path, args) -> Path:
    """The learner's config: the chain task, trained only from ingested groups."""
    import tomli_w

    from rollwire.learner.config import LearnerConfig
    from rollwire.runtime.config import dump_config, load_config

    config = {
        "target": target,
        "base_model": str(model),
        "run_dir": str(run / "learner"),
        "metrics_port": 0,
        "max_seconds": args.budget_s,
        "max_steps": args.max_steps,
        "progress": False,
        "task": {"kind": "chain", "eval_size": args.eval_size},
        "train": {"threads": 1, "groups_per_step": 4, "lr": 2e-3},
        "eval": {"every_steps": args.eval_every},
        "checkpoint": {"every_steps": 0},
        "buffer": {"max_staleness": 2},
        "ingest": {
            "enabled": True,
            "exclusive": True,
            "port": 0,
            "max_pending_groups": 12,
            "producer_share": 1.0,  # one producer, on this host: it may fill the learner
            "retry_after_s": 0.2,
        },
    }
    path = run / "learner.toml"
    path.write_text(tomli_w.dumps(config))
    if args.overrides:
        path.write_text(dump_config(load_config(LearnerConfig, path, args.overrides)))
    return path


def start_producer(run: Path, target: str, learner: str, model: Path, args, cpus) -> subprocess.Popen:
    """examples/agent_producer.py as its own process, until the learner stops taking trajectories."""
    cmd = [
        sys.executable, str(PRODUCER), "--target", target, "--learner", learner, "--model", str(model),
        "--seconds", str(args.budget_s + 600), "--concurrency", str(args.concurrency),
        "--stats-file", str(run / "producer.json"),
    ]  # fmt: skip
    with (run / "producer.log").open("ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    pin(proc.pid, cpus)
    return proc


def stop_producer(proc: subprocess.Popen, run: Path, timeout: float = 60) -> dict:
    """Wait for the producer to see the learner gone and write its counts (killed after `timeout`)."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    try:
        return json.loads((run / "producer.json").read_text())
    except (OSError, ValueError):
        return {}


def serving_counts(proxy: Service, replicas: list[Service]) -> dict:
    """What the serving side did with the episodes: the proxy's session routes, the replicas' prefix KV reuse."""
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    def scrape(service: Service) -> dict[str, float]:
        totals: dict[str, float] = {}
        try:
            with urlopen(f"http://{service.host}:{service.metrics_port}/metrics", timeout=10) as reply:
                text = reply.read().decode()
        except OSError:
            return totals
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                key = s.name + "".join(f":{v}" for v in s.labels.values())
                totals[key] = totals.get(key, 0.0) + s.value
        return totals

    routes = {
        k.split(":", 1)[1]: int(v)
        for k, v in scrape(proxy).items()
        if k.startswith("rollwire_proxy_session_routes_total:")
    }
    hit = computed = 0.0
    for replica in replicas:
        metrics = scrape(replica)
        hit += metrics.get("rollwire_generator_prefix_cache_hit_tokens_total", 0.0)
        computed += metrics.get("rollwire_generator_prefill_tokens_total", 0.0)
    later = sum(v for k, v in routes.items() if k != "first")
    return {
        "session_routes": routes,
        "sticky_rate": round(routes.get("sticky", 0) / later, 4) if later else None,
        "prefix_hit_tokens": int(hit),
        "prefill_tokens": int(computed),
        "prefix_hit_rate": round(hit / (hit + computed), 4) if hit + computed else None,
    }


def learner_ingest(run: Path) -> dict:
    return json.loads((run / "learner" / "summary.json").read_text()).get("ingest") or {}


def ingest_rows(s: dict) -> list[tuple[str, str]]:
    produced, ingest = s.get("producer") or {}, s.get("ingest") or {}
    trajectories = ingest.get("trajectories", {})
    refused = {k: v for k, v in trajectories.items() if k not in ("accepted", "trained", "expired", "dropped")}
    serving = s.get("serving") or {}
    return [
        ("task", "chained addition, 3 turns: held-out accuracy is the share of episodes with every turn right"),
        (
            "producer",
            f"{produced.get('groups', 'n/a')} groups, {produced.get('episodes', 'n/a')} episodes, "
            f"sampled success {produced.get('sampled_success')}",
        ),
        (
            "ingested",
            f"{trajectories.get('accepted', 0)} trajectories accepted: {trajectories.get('trained', 0)} trained, "
            f"{trajectories.get('dropped', 0)} dropped with their group, {trajectories.get('expired', 0)} expired; "
            f"refused {refused or 'none'}",
        ),
        (
            "sessions",
            f"sticky turns {serving.get('sticky_rate')} of later turns {serving.get('session_routes')}; "
            f"prefix KV reuse {serving.get('prefix_hit_rate')} of prompt tokens",
        ),
    ]


if __name__ == "__main__":
    sys.exit(main())
