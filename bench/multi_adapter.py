"""Many adapters on one replica (issue 35, item 3): tokens/s with 1, 2, 4 and 8 adapters under the same load.

The load is the same in every mode: G groups of n samples, each exactly T new tokens
(ignore_eos), temperature 1, all sent at once to one transformers replica (tiny model, 2 CPU
cores). Eight adapters (r=8 on every linear layer, different weights, each its own name as a
tenant's would be) are loaded in every mode; mode k sends group g to adapter g mod k, so k
adapters' rows share the batch. `base` sends every group to the base model. The figure is
tokens/s of k adapters over that of 1 adapter, from the same repeat (the goal: >= 0.8x), in
two clocks: wall time, and the replica process's CPU time (user + system; with one torch
thread the replica uses about one core, so tokens per CPU-second is its tokens/s on an idle
core, and on a shared machine it moves far less with the neighbours' load than wall time).

With --baseline REF a second replica runs the engine's LoRA apply as it was at git revision
REF (this working tree with lora.py taken from REF) under the same load, alternating with
this tree's within each repeat (and the modes' order alternates too), so drift of a shared
machine hits both.
Run: .venv/bin/python bench/multi_adapter.py [--repeats 3] [--threads 1] [--baseline main]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
from pathlib import Path

from common import ROOT, WORK, Timer, cpu_seconds, spread, tiny_model, write_result
from generator_efficiency import start_generator

from rollwire.client import AsyncClient, Client

GROUPS, N, TOKENS = 16, 8, 48
ADAPTERS, LORA_R = 8, 8
MODES = ("base", "1", "2", "4", "8")
LORA_FILE = "server/rollwire/generator/engines/embedded/lora.py"


def payloads(model_dir: Path) -> list[bytes]:
    """ADAPTERS random LoRA adapters (r=8, every linear layer) in PEFT's format."""
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import save
    from transformers import AutoModelForCausalLM

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_dir),
        LoraConfig(r=LORA_R, lora_alpha=2 * LORA_R, target_modules="all-linear", init_lora_weights=False),
    )
    out = []
    for seed in range(ADAPTERS):
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        out.append(save({k: v.contiguous() for k, v in get_peft_model_state_dict(model).items()}))
    return out


def push_all(target: str, model_dir: Path, blobs: list[bytes]) -> None:
    from rollwire.common.fingerprint import model_fingerprint

    lora = {"r": LORA_R, "lora_alpha": 2 * LORA_R, "target_modules": ["all-linear"]}
    with Client(target, timeout=120) as c:
        for i, blob in enumerate(blobs):
            c.push_adapter(f"tenant{i}", 1, blob, lora, model_fingerprint(model_dir))


def load(gen, mode: str) -> tuple[float, float]:
    """Tokens per second of wall time and per second of the replica's CPU time, for the whole
    load, every group sent at once."""
    target = gen.target

    async def run() -> float:
        async with AsyncClient(target, timeout=600) as c:
            with Timer() as t:
                await asyncio.gather(
                    *(
                        c.generate(
                            f"group {g}: 12+34=",
                            N,
                            seed=g,
                            adapter=None if mode == "base" else f"tenant{g % int(mode)}@1",
                            max_new_tokens=TOKENS,
                            ignore_eos=True,
                            temperature=1.0,
                        )
                        for g in range(GROUPS)
                    )
                )
        return t.seconds

    cpu = cpu_seconds(gen.proc.pid)
    wall = asyncio.run(run())
    cpu = cpu_seconds(gen.proc.pid) - cpu
    return GROUPS * N * TOKENS / wall, GROUPS * N * TOKENS / cpu


def baseline_tree(ref: str) -> Path:
    """This working tree's client/ and server/ with lora.py as it was at `ref`."""
    tree = WORK / f"baseline-lora-{ref}"
    shutil.rmtree(tree, ignore_errors=True)
    for part in ("client", "server"):
        shutil.copytree(ROOT / part, tree / part, ignore=shutil.ignore_patterns("__pycache__"))
    old = subprocess.run(["git", "show", f"{ref}:{LORA_FILE}"], cwd=ROOT, capture_output=True, check=True).stdout
    (tree / LORA_FILE).write_bytes(old)
    return tree


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each replica (0 = torch's default)")
    ap.add_argument("--baseline", metavar="REF", help="also run the LoRA apply as it was at this git revision")
    args = ap.parse_args()
    if args.baseline:  # name the commit, so the results stay meaningful after HEAD moves
        args.baseline = subprocess.run(
            ["git", "rev-parse", "--short", args.baseline], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    model = tiny_model()
    blobs = payloads(model)
    engines = {"": start_generator(model, args.threads, "bench-multi-adapter")}
    if args.baseline:
        tree = baseline_tree(args.baseline)
        engines[f"{args.baseline} "] = start_generator(model, args.threads, "bench-multi-adapter-baseline", tree)
    runs: list[dict[str, float]] = []
    load_avg = [os.getloadavg()[0]]  # the machine's 1-minute load average, at the start and after each repeat
    try:
        for gen in engines.values():
            push_all(gen.target, model, blobs)
            for mode in MODES:
                load(gen, mode)  # warm-up
        for repeat in range(args.repeats):
            step = 1 if repeat % 2 == 0 else -1
            run: dict[str, float] = {}
            for label, gen in list(engines.items())[::step]:
                for mode in MODES[::step]:
                    run[label + mode], run["cpu " + label + mode] = load(gen, mode)
            runs.append(run)
            load_avg.append(os.getloadavg()[0])
            print(f"repeat {repeat}: " + ", ".join(f"{k}={v:.0f}" for k, v in run.items()))
    finally:
        for gen in engines.values():
            gen.stop()
    tokens_per_s = {m: spread([r[m] for r in runs]) for m in runs[0]}
    ratios = {}
    for label in [*engines, *(f"cpu {e}" for e in engines)]:
        for mode in MODES:
            ratios[f"{label}{mode}/1"] = spread([r[label + mode] / r[label + "1"] for r in runs])
    for m, s in tokens_per_s.items():
        print(f"{m + ' adapters':24s} {s['median']:9.0f} tokens/s  (min {s['min']:.0f}, max {s['max']:.0f})")
    for k, s in ratios.items():
        print(f"{k:24s} {s['median']:.2f}x  (min {s['min']:.2f}, max {s['max']:.2f})")
    command = "bench/multi_adapter.py" + "".join(
        f" --{k} {v}"
        for k, v in (("repeats", args.repeats), ("threads", args.threads), ("baseline", args.baseline))
        if v
    )
    write_result(
        "multi_adapter",
        f".venv/bin/python {command}",
        {
            "workload": {"groups": GROUPS, "n": N, "new_tokens": TOKENS, "lora_r": LORA_R, "adapters_loaded": ADAPTERS},
            "tokens_per_s": tokens_per_s,
            "ratios": ratios,
            "load_avg": spread(load_avg),
        },
    )


if __name__ == "__main__":
    main()
