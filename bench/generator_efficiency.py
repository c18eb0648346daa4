"""Generator efficiency: the transformers engine under concurrent load vs plain model.generate.

Same work in every mode: G groups of n samples, each exactly T new tokens (ignore_eos),
temperature 1, on the tiny model, 2 CPU cores.
  sequential   one group at a time through a real generator process (no batching possible)
  concurrent   all G groups at once through the same generator (continuous batching)
  concurrent-lora  the same, every group on a LoRA adapter (r=8, all linear layers), half
               of them on version 1 and half on version 2, as in an asynchronous run
  hf-generate  plain `model.generate` in one process, one group (n rows) per call
  hf-batch     plain `model.generate` with all G*n rows in one call (the static-batch ideal)
With --baseline REF a second generator runs the same served modes on the engine as it was
at git revision REF (this working tree with ENGINE_FILES taken from REF), in the same run;
the two alternate within each repeat, first one then the other, so drift of a shared
machine hits both.
Every process gets --threads torch threads (default 1, as in the demo: with torch's default
a 2-core machine shared with other processes thrashes and the figures mean nothing).
Run: .venv/bin/python bench/generator_efficiency.py [--repeats 3] [--threads 1] [--baseline HEAD]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from common import ROOT, WORK, Timer, spread, tiny_model, write_result

from rollwire.client import AsyncClient, Client
from rollwire.demo.stack import start

GROUPS, N, DEFAULT_TOKENS = 16, 8, 48
TOKENS = DEFAULT_TOKENS  # --tokens
LORA_R = 8
# What --baseline takes from REF: the embedded engine and its sampling. Modules the new code
# added stay in the copy, unused by the old engine.
ENGINE_FILES = (
    "server/rollwire/generator/engines/embedded/transformers_engine.py",
    "server/rollwire/generator/sampling.py",
)


def hf_modes(model_dir, threads: int) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if threads:
        torch.set_num_threads(threads)  # the same threads as the generator, so the ratios compare like with like

    tok = AutoTokenizer.from_pretrained(model_dir)
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir).eval()  # transformers' stubs lack generate()
    kwargs = dict(max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=True, top_k=0, top_p=1.0, pad_token_id=0)
    prompts = [f"group {g}: 12+34=" for g in range(GROUPS)]
    out = {}
    with torch.no_grad(), Timer() as t:
        for p in prompts:
            ids = tok([p] * N, return_tensors="pt", padding=True)
            model.generate(**ids, **kwargs)
    out["hf-generate"] = GROUPS * N * TOKENS / t.seconds
    with torch.no_grad(), Timer() as t:
        ids = tok([p for p in prompts for _ in range(N)], return_tensors="pt", padding=True)
        model.generate(**ids, **kwargs)
    out["hf-batch"] = GROUPS * N * TOKENS / t.seconds
    return out


def served_modes(target: str) -> dict[str, float]:
    with Client(target, timeout=600) as c, Timer() as t:
        for g in range(GROUPS):
            c.generate(f"group {g}: 12+34=", N, seed=g, max_new_tokens=TOKENS, ignore_eos=True, temperature=1.0)
    sequential = GROUPS * N * TOKENS / t.seconds

    async def concurrent(lora: bool) -> float:
        async with AsyncClient(target, timeout=600) as c:
            with Timer() as t:
                await asyncio.gather(
                    *(
                        c.generate(
                            f"group {g}: 12+34=",
                            N,
                            seed=g,
                            adapter=f"bench@{1 + g % 2}" if lora else None,
                            max_new_tokens=TOKENS,
                            ignore_eos=True,
                            temperature=1.0,
                        )
                        for g in range(GROUPS)
                    )
                )
        return GROUPS * N * TOKENS / t.seconds

    return {
        "sequential": sequential,
        "concurrent": asyncio.run(concurrent(False)),
        "concurrent-lora": asyncio.run(concurrent(True)),
    }


def lora_payloads(model_dir: Path) -> list[bytes]:
    """Two versions of a random LoRA adapter (r=8 on every linear layer) in PEFT's format."""
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import save
    from transformers import AutoModelForCausalLM

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_dir),
        LoraConfig(r=LORA_R, lora_alpha=2 * LORA_R, target_modules="all-linear", init_lora_weights=False),
    )
    payloads = []
    for seed in (1, 2):
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        payloads.append(save({k: v.contiguous() for k, v in get_peft_model_state_dict(model).items()}))
    return payloads


def push_versions(target: str, model_dir: Path, payloads: list[bytes]) -> None:
    from rollwire.common.fingerprint import model_fingerprint

    lora = {"r": LORA_R, "lora_alpha": 2 * LORA_R, "target_modules": ["all-linear"]}
    with Client(target, timeout=120) as c:
        for version, payload in enumerate(payloads, 1):
            c.push_adapter("bench", version, payload, lora, model_fingerprint(model_dir))


def baseline_tree(ref: str) -> Path:
    """This working tree's client/ and server/ with ENGINE_FILES as they were at `ref`."""
    tree = WORK / f"baseline-{ref.replace('/', '_')}"
    shutil.rmtree(tree, ignore_errors=True)
    for part in ("client", "server"):
        shutil.copytree(ROOT / part, tree / part, ignore=shutil.ignore_patterns("__pycache__"))
    for path in ENGINE_FILES:
        old = subprocess.run(["git", "show", f"{ref}:{path}"], cwd=ROOT, capture_output=True, check=True).stdout
        (tree / path).write_bytes(old)
    return tree


@contextmanager
def python_path(tree: Path | None):
    """Children started inside import rollwire from `tree` first (None: this checkout)."""
    before = os.environ.get("PYTHONPATH")
    if tree is not None:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(tree / "client"), str(tree / "server")])
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before


def start_generator(model: Path, threads: int, name: str, tree: Path | None = None):
    args = ["generator", "--model", str(model), "--port", "0", "--metrics-port", "0"]
    if threads:
        args += ["--set", f"transformers.threads={threads}"]
    with python_path(tree):
        return start(args, WORK, name)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of the generator and of the hf modes (0 = torch's default, which thrashes on a busy 2-core machine)",
    )
    ap.add_argument("--baseline", metavar="REF", help="also run the engine as it was at this git revision")
    ap.add_argument(
        "--tokens",
        type=int,
        default=DEFAULT_TOKENS,
        help=f"new tokens per sample (default {DEFAULT_TOKENS}; the RL task of bench/peer_trl.py samples 8, where prefill weighs more)",
    )
    args = ap.parse_args()
    global TOKENS
    TOKENS = args.tokens
    if args.baseline:  # name the commit, so the results stay meaningful after HEAD moves
        args.baseline = subprocess.run(
            ["git", "rev-parse", "--short", args.baseline], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    model = tiny_model()
    payloads = lora_payloads(model)
    engines = {"": start_generator(model, args.threads, "bench-generator")}
    if args.baseline:
        tree = baseline_tree(args.baseline)
        engines[f"{args.baseline} "] = start_generator(model, args.threads, "bench-generator-baseline", tree)
    runs: list[dict[str, float]] = []
    try:
        for gen in engines.values():
            push_versions(gen.target, model, payloads)
            served_modes(gen.target)  # warm-up
        for repeat in range(args.repeats):
            order = list(engines.items())[:: 1 if repeat % 2 == 0 else -1]
            run: dict[str, float] = {}
            for label, gen in order:
                run.update({label + mode: v for mode, v in served_modes(gen.target).items()})
            runs.append({**run, **hf_modes(model, args.threads)})
    finally:
        for gen in engines.values():
            gen.stop()
    tokens_per_s = {m: spread([r[m] for r in runs]) for m in runs[0]}
    ratios = {}
    for label in engines:
        pairs = [
            ("concurrent", label + "sequential"),
            ("concurrent", "hf-generate"),
            ("concurrent", "hf-batch"),
            ("concurrent-lora", "hf-batch"),
        ]
        for mode, reference in pairs:
            ratios[f"{label}{mode}/{reference}"] = spread([r[label + mode] / r[reference] for r in runs])
    if args.baseline:
        for mode in ("sequential", "concurrent", "concurrent-lora"):
            ratios[f"{mode}: this tree/{args.baseline}"] = spread(
                [r[mode] / r[f"{args.baseline} {mode}"] for r in runs]
            )
    for m, s in tokens_per_s.items():
        print(f"{m:28s} {s['median']:9.0f} tokens/s  (min {s['min']:.0f}, max {s['max']:.0f})")
    for k, s in ratios.items():
        print(f"{k:40s} {s['median']:.2f}x  (min {s['min']:.2f}, max {s['max']:.2f})")
    command = "bench/generator_efficiency.py" + "".join(
        f" --{k} {v}"
        for k, v in (
            ("threads", args.threads),
            ("baseline", args.baseline),
            ("tokens", args.tokens if args.tokens != DEFAULT_TOKENS else None),
        )
        if v
    )
    write_result(
        "generator_efficiency" if TOKENS == DEFAULT_TOKENS else f"generator_efficiency-{TOKENS}tok",
        f".venv/bin/python {command}",
        {
            "workload": {"groups": GROUPS, "n": N, "new_tokens": TOKENS, "lora_r": LORA_R, "threads": args.threads},
            "tokens_per_s": tokens_per_s,
            "ratios": ratios,
        },
    )


if __name__ == "__main__":
    main()
