"""In-flight updates on the built-in task: following the newest version vs pinned, and a push storm.

Part 1, learning (the setup of bench/async_vs_sync.py: the taught tiny model, 2 replicas,
1 proxy, `rollwire learner` with max_staleness 1 for a fixed wall-clock budget, scored by
its Watcher): `pinned` (a group finishes on the version it started on, the default) and
`follow` (rollout.follow: running samples switch to each newly committed version), the two
alternating per repeat, same seed. Figures: the staleness of trained tokens (mean and max
versions behind the trained weights), trained groups/s, time to 90% held-out accuracy.

Part 2, a push storm (one replica of the tiny model): 32 concurrent groups following
`storm@latest` (n=2, 60 new tokens each) with and without 10 versions pushed while they run,
alternating; figures: tokens/s with pushes over without, and restarted or failed samples
(must be 0).
Run: .venv/bin/python bench/follow_vs_pinned.py [--repeats 2] [--budget-s 20]
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor

from async_vs_sync import figures, learn, start_stack, taught_model
from common import WORK, spread, stop_all, tiny_model, write_result

MODES = {"pinned": (), "follow": ("rollout.follow=true",)}
STORM_GROUPS, STORM_PUSHES, STORM_TOKENS = 32, 10, 60


def learning(repeats: int, budget_s: float) -> dict:
    model = taught_model()
    stack = start_stack(model)
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    try:
        learn(stack[-1].target, model, "follow-warmup", 1, "max_steps=3", "eval.at_end=false")
        for index in range(repeats):
            for mode, settings in MODES.items():
                run, scores = learn(stack[-1].target, model, f"{mode}-{index}", 1, f"max_seconds={budget_s}", *settings)
                summary = json.loads((run / "summary.json").read_text())
                result = figures(run, scores) | {
                    "token_staleness_mean": summary.get("token_staleness_mean"),
                    "token_staleness_max": summary.get("token_staleness_max"),
                }
                runs[mode].append(result)
                print(
                    f"{mode:6s} #{index}: {result['groups_per_s']:.2f} groups/s, tokens "
                    f"{result['token_staleness_mean']:.3f} versions behind (max {result['token_staleness_max']}), "
                    f"accuracy {result['accuracy_before']:.3f} -> {result['accuracy_after']:.3f}, "
                    f"90% after {result['seconds_to_target']} s",
                    flush=True,
                )
    finally:
        stop_all(reversed(stack))
    keys = ("groups_per_s", "token_staleness_mean", "token_staleness_max", "seconds_to_target", "accuracy_after")
    per_mode = {
        mode: {
            k: spread([r[k] for r in rs if r[k] is not None]) if any(r[k] is not None for r in rs) else None
            for k in keys
        }
        for mode, rs in runs.items()
    }
    pairs = list(zip(runs["pinned"], runs["follow"], strict=True))
    ratios = {"trained groups/s follow/pinned": spread([f["groups_per_s"] / p["groups_per_s"] for p, f in pairs])}
    return {"per_mode": per_mode, "ratios": ratios, "runs": runs}


def storm(repeats: int) -> dict:
    from rollwire.client import Client, Restarted, Tokens
    from rollwire.demo.stack import start_generators

    model = tiny_model()
    replica = start_generators(model, WORK, ["storm-replica"], "--set", "transformers.threads=1")[0]
    adapters = _adapters(model, STORM_PUSHES * (2 * repeats + 1) + 1)
    version = [0]
    try:
        with Client(replica.target, timeout=120) as client:
            fp = client.get_status().model_fingerprint

            def push_next() -> None:
                version[0] += 1
                payload, lora = adapters[version[0]]
                client.push_adapter("storm", version[0], payload, lora, fp)

            push_next()
            rates: dict[str, list[float]] = {"quiet": [], "storm": []}
            broken = 0

            def one(seed: int) -> tuple[int, int]:
                tokens, restarts = 0, 0
                for event in client.generate_stream(
                    [5, 6, 7],
                    2,
                    max_new_tokens=STORM_TOKENS,
                    ignore_eos=True,
                    seed=seed,
                    adapter="storm@latest",
                    follow=True,
                ):
                    tokens += len(event.token_ids) if isinstance(event, Tokens) else 0
                    restarts += isinstance(event, Restarted)
                return tokens, restarts

            for _ in range(repeats):
                for mode in ("quiet", "storm"):
                    started = time.perf_counter()
                    with ThreadPoolExecutor(STORM_GROUPS) as pool:
                        runs = [pool.submit(one, s) for s in range(STORM_GROUPS)]
                        if mode == "storm":
                            for _ in range(STORM_PUSHES):
                                push_next()
                        results = [r.result() for r in runs]
                    wall = time.perf_counter() - started
                    broken += sum(r for _, r in results) + sum(t != 2 * STORM_TOKENS for t, _ in results)
                    rates[mode].append(sum(t for t, _ in results) / wall)
                    print(f"storm: {mode:5s} {rates[mode][-1]:.0f} tokens/s", flush=True)
    finally:
        stop_all([replica])
    ratio = spread([s / q for q, s in zip(rates["quiet"], rates["storm"], strict=True)])
    return {
        "tokens_per_s": {k: spread(v) for k, v in rates.items()},
        "storm_over_quiet": ratio,
        "broken_samples": broken,
    }


def _adapters(model, count: int) -> list:
    """`count` random LoRA adapters of the tiny model (index 0 unused)."""
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import save
    from transformers import AutoModelForCausalLM

    from rollwire.common.lora import LoraShape

    model_ = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])
    )
    out: list = [None]
    for seed in range(1, count + 1):
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model_.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        out.append(
            (
                save({k: v.contiguous() for k, v in get_peft_model_state_dict(model_).items()}),
                LoraShape(2, 4.0, ("q_proj", "v_proj")),
            )
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=20.0, help="training seconds of each learning run")
    args = ap.parse_args()
    from rollwire.runtime.logs import setup_logging

    setup_logging("bench", "error")
    stormed = storm(3)
    print(
        f"storm/quiet tokens/s {stormed['storm_over_quiet']['median']:.2f}, broken samples {stormed['broken_samples']}"
    )
    learned = learning(args.repeats, args.budget_s)
    write_result(
        "follow_vs_pinned",
        ".venv/bin/python bench/follow_vs_pinned.py",
        {
            "workload": {
                "budget_s": args.budget_s,
                "max_staleness": 1,
                "storm": [STORM_GROUPS, STORM_PUSHES, STORM_TOKENS],
            },
            "storm": stormed,
            **learned,
        },
    )


if __name__ == "__main__":
    main()
