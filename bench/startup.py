"""How long rollwire's processes take from spawn to serving, for two versions of the code side
by side (issue 33: the suite's time is mostly process start-ups; Kubernetes scaling waits on
them too).

Each version is a source tree: `.` (this checkout) or a git revision, exported with
`git archive` into a temporary folder. A measurement runs a fresh driver interpreter with
that tree first on its path, which starts processes exactly as the tests do (that tree's
rollwire.demo.stack, so its own waits are measured with it) and times:

- help_s: `rollwire --help` from spawn to exit, help_cpu_s its CPU seconds;
- floor_cpu_s: the CPU seconds of `import torch` and transformers' Llama classes alone, which
  a replica cannot start without (the same code in both versions: how busy the machine was);
- generator_s: `rollwire generator` of the tiny model with the tests' settings, spawn to
  serving (its ready file and a ready plaintext channel: what tests/support/processes.py waits
  for), and generator_cpu_s, the CPU seconds it used by then;
- proxy_s: `rollwire proxy` over that one replica, spawn to serving, proxy_cpu_s likewise;
- routable_s: the proxy serving to it routing to the replica (wait_routable);
- stop_s: both stopped (SIGTERM, drained, exited), as a test's teardown does.

`--revert C1,C2` measures the changes of those commits alone: before is --after's tree with
their patches reverse-applied.

The versions alternate within each repeat (A B, then B A, ...), so a busy moment of a shared
machine falls on both. Writes bench/results/startup.json; report.py renders docs/benchmarks.md.

    .venv/bin/python bench/startup.py --before REV --after . --repeats 5
    .venv/bin/python bench/startup.py --revert C1,C2 --after HEAD --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from common import ROOT, spread, tiny_model, write_result

DRIVER = r"""
import json, resource, shutil, subprocess, sys, tempfile, time
from pathlib import Path
from rollwire.demo import stack

model, out = Path(sys.argv[1]), {}
work = Path(tempfile.mkdtemp(prefix="rollwire-startup-"))

def child_cpu():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime

t, c = time.monotonic(), child_cpu()
subprocess.run(stack.rollwire_cmd("--help"), stdout=subprocess.DEVNULL, check=True)
out["help_s"], out["help_cpu_s"] = time.monotonic() - t, child_cpu() - c
c = child_cpu()
subprocess.run([sys.executable, "-c", FLOOR], check=True)
out["floor_cpu_s"] = child_cpu() - c

def cpu(service):
    with open(f"/proc/{service.proc.pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / __import__("os").sysconf("SC_CLK_TCK")

tests_args = ("--set", "limits.max_n=16", "--set", "limits.max_new_tokens=128", "--set", "transformers.threads=1",
              "--set", "grace_seconds=1", "--replica-id", "generator")
t = time.monotonic()
gen = stack.start(stack.generator_args(model, *tests_args), work, "generator", 120, probe=True)
out["generator_s"], out["generator_cpu_s"] = time.monotonic() - t, cpu(gen)
try:
    t = time.monotonic()
    proxy = stack.start_proxy(work, "proxy", [gen], "--proxy-id", "proxy", "--set", "health.interval_s=0.2", probe=True)
    out["proxy_s"], out["proxy_cpu_s"] = time.monotonic() - t, cpu(proxy)
    t = time.monotonic()
    stack.wait_routable(proxy, [gen])
    out["routable_s"] = time.monotonic() - t
    t = time.monotonic()
    stack.stop_all([proxy, gen])
    out["stop_s"] = time.monotonic() - t
finally:
    gen.kill() if gen.proc.poll() is None else None
shutil.rmtree(work, ignore_errors=True)
print(json.dumps(out))
""".replace("FLOOR", repr("import torch; from transformers import AutoModelForCausalLM, LlamaForCausalLM"))
FIGURES = (
    "help_s",
    "help_cpu_s",
    "floor_cpu_s",
    "generator_s",
    "generator_cpu_s",
    "proxy_s",
    "proxy_cpu_s",
    "routable_s",
    "stop_s",
)


def export(rev: str, into: Path, revert: Sequence[str] = ()) -> Path:
    """The tree of `rev` (`.`: this checkout as it is) as a folder of sources, with the changes
    of the `revert` commits taken back out (newest first), to measure them alone."""
    if rev == "." and not revert:
        return ROOT
    into.mkdir(parents=True)
    if rev == ".":
        subprocess.run(["cp", "-a", f"{ROOT}/client", f"{ROOT}/server", f"{ROOT}/learner", str(into)], check=True)
    else:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    for commit in revert:
        patch = subprocess.run(["git", "-C", str(ROOT), "show", "--format=", commit], capture_output=True, check=True)
        subprocess.run(["git", "apply", "-R", "--include=client/*", "--include=server/*", "--include=learner/*"],
                       input=patch.stdout, cwd=into, check=True)  # fmt: skip
    return into


def measure(tree: Path, model: Path) -> dict[str, float]:
    """One driver run with `tree`'s rollwire first on the path."""
    path = os.pathsep.join(str(tree / part) for part in ("client", "server", "learner"))
    env = {**os.environ, "PYTHONPATH": path + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, str(model)], env=env, capture_output=True, text=True, timeout=600, cwd=tree
    )
    if proc.returncode != 0:
        raise SystemExit(f"the driver failed on {tree}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--before", default="HEAD", help="git revision (or .) measured as before (default HEAD)")
    parser.add_argument("--after", default=".", help="git revision (or .) measured as after (default: this checkout)")
    parser.add_argument(
        "--revert", default="", help="comma-separated commits whose changes the before tree takes out of --after"
    )
    parser.add_argument("--repeats", type=int, default=5, help="runs of each version, alternating (default 5)")
    args = parser.parse_args()
    model = tiny_model()
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="rollwire-trees-") as tmp:
        revert = [c for c in args.revert.split(",") if c]
        trees = {
            "before": export(args.after, Path(tmp, "before"), revert)
            if revert
            else export(args.before, Path(tmp, "before")),
            "after": export(args.after, Path(tmp, "after")),
        }
        for repeat in range(args.repeats):
            for name in ("before", "after") if repeat % 2 == 0 else ("after", "before"):
                runs[name].append(measure(trees[name], model))
                print(repeat, name, json.dumps({k: round(v, 3) for k, v in runs[name][-1].items()}), flush=True)
    data = {
        "revisions": {
            "before": f"{args.after} without {args.revert}" if args.revert else args.before,
            "after": args.after,
        },
        "per_version": {
            name: {figure: spread([run[figure] for run in done]) for figure in FIGURES} for name, done in runs.items()
        },
        "runs": runs,
    }
    versions = f"--revert {args.revert}" if args.revert else f"--before {args.before}"
    command = f".venv/bin/python bench/startup.py {versions} --after {args.after} --repeats {args.repeats}"
    print(write_result("startup", command, data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
