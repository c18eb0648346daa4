"""The trainer process of `make demo-trl`: TRL's `AsyncGRPOTrainer`, unmodified, on the built-in task.

`python -m rollwire.demo.trl_trainer --url http://HOST:PORT --model DIR --out DIR` trains a LoRA
adapter of the taught tiny model with TRL 1.16's asynchronous GRPO trainer against a server
that speaks vLLM's HTTP API (rollwire's proxy, through its HTTP front door). TRL does
everything as it would against vLLM: it probes the server, saves each version as an adapter
folder, loads it with `/v1/load_lora_adapter` as `trl-policy-vN`, and its spawned rollout
worker samples with `/v1/completions`. What this module adds is only what a TRL user writes:
the dataset, the reward function, the config, and a callback that records each step and stops
at the time budget. Where there is no GPU, the stand-ins of rollwire.demo.trl_cpu are installed
first (CPU kernels for TRL's GPU-only parts).

Invariants:
- the task is the learner's: the training split of rollwire.learner.tasks.task's addition problems
  (never a held-out prompt), in an order fixed by the seed, each a one-message chat the tiny
  tokenizer's chat template renders as the raw prompt; rewarded by the learner's exact_match;
- the settings are the learner's defaults where both have one (n, groups per step, LoRA,
  lr, tokens, temperature, clip), so the two trainers learn the same problem; staleness is
  TRL's own default (max_staleness 4, so the server must serve 6 versions at once: what a
  TRL user meets) unless --max-staleness sets it;
- `out/steps.jsonl` gets one JSON line per optimiser step (TRL's logged metrics, the version
  being served, seconds since training began); `out/summary.json` is written only when
  training ended normally and names the last version TRL loaded (versions run 1..last).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

from rollwire.learner.config import (
    LORA_TARGETS,
    LearnerConfig,
    RolloutSection,
    TaskSection,
    TrainSection,
)
from rollwire.learner.tasks.rewards import exact_match
from rollwire.learner.tasks.task import Example, addition_examples

ROLLOUT, TRAIN, TASK = RolloutSection(), TrainSection(), TaskSection()
"""The learner's defaults, which this demo matches."""
SEED: int = LearnerConfig.model_fields["seed"].default
LOGGED = (
    "reward",
    "reward_std",
    "ratio",
    "kl",
    "entropy",
    "loss",
    "grad_norm",
    "sample/staleness_mean",
    "sample/staleness_max",
    "sample/dropped_stale_total",
    "perf/weight_sync_s",
    "perf/weight_sync_pause_s",
    "perf/weight_sync_transfer_s",
    "perf/step_s",
    "perf/rollout_wait_s",
    "perf/fwd_bwd_s",
    "rollout/duration_s",
    "rollout/generated_tok_s",
    "sample/rollout_queue_size",
    "batch/samples_per_step",
    "batch/groups_per_step",
)
"""TRL's metrics copied into steps.jsonl (when it logged them that step)."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rollwire.demo.trl_trainer", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--url", required=True, help="base URL of the vLLM-compatible server (the proxy's HTTP door)")
    p.add_argument("--model", required=True, help="base model folder (the taught tiny model)")
    p.add_argument("--out", required=True, help="TRL's output_dir; steps.jsonl and summary.json go here too")
    p.add_argument("--budget-s", type=float, default=90.0, help="seconds of training, from train begin")
    p.add_argument("--max-steps", type=int, default=1000, help="optimiser steps at most")
    p.add_argument("--seed", type=int, default=SEED, help="data order and TRL's seed")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the trainer")
    p.add_argument(
        "--num-generations",
        type=int,
        default=ROLLOUT.n,
        help="TRL's num_generations (default: the learner's n, %(default)s)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="TRL's per_device_train_batch_size, in completions (default: the learner's groups_per_step whole groups)",
    )
    p.add_argument(
        "--max-completion-length",
        type=int,
        default=ROLLOUT.max_new_tokens,
        help="TRL's max_completion_length (default: the learner's max_new_tokens, %(default)s)",
    )
    p.add_argument(
        "--gradient-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="TRL's gradient_checkpointing (TRL's own default is on; off by default here, as on a CPU it only costs time)",
    )
    p.add_argument(
        "--max-staleness",
        type=int,
        default=None,
        help="TRL's max_staleness (default: TRL's own, 4; the server must serve max_staleness + 2 versions)",
    )
    return p.parse_args(argv)


def exact_match_reward(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
    """The learner's exact_match in TRL's reward shape: one float per completion.

    TRL's worker passes conversational completions (lists of messages, the assistant's last)
    and the dataset's other columns by name; module-level, so TRL's spawned worker unpickles it."""
    return [
        exact_match(_completion_text(completion), Example(0, "", expected))
        for completion, expected in zip(completions, answer, strict=True)
    ]


def _completion_text(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    return str(completion[-1].get("content") or "") if completion else ""


def train_dataset(seed: int):
    """The training split as TRL's conversational prompts with their answers, in a seeded order."""
    from datasets import Dataset

    train, _held = addition_examples(TASK.held_out_fraction)
    random.Random(seed).shuffle(train)
    return Dataset.from_list([{"prompt": [{"role": "user", "content": e.prompt}], "answer": e.answer} for e in train])


def trainer_config(args: argparse.Namespace):
    """AsyncGRPOConfig for a CPU: the learner's settings, TRL's CPU-hostile defaults off."""
    from trl.experimental.async_grpo.async_grpo_config import AsyncGRPOConfig

    return AsyncGRPOConfig(
        output_dir=args.out,
        vllm_server_base_url=args.url,
        num_generations=args.num_generations,
        # Counts completions: by default groups_per_step whole groups in one micro-batch of fixed
        # size (token_budget 0), one optimiser step per micro-batch.
        per_device_train_batch_size=args.batch_size or args.num_generations * TRAIN.groups_per_step,
        gradient_accumulation_steps=1,
        token_budget=0,
        max_completion_length=args.max_completion_length,
        temperature=ROLLOUT.temperature,
        top_p=1.0,
        top_k=0,
        learning_rate=TRAIN.lr,
        weight_decay=TRAIN.weight_decay,
        max_grad_norm=TRAIN.max_grad_norm,
        epsilon=TRAIN.clip_low,
        epsilon_high=TRAIN.clip_high,
        **({} if args.max_staleness is None else {"max_staleness": args.max_staleness}),  # TRL's default otherwise
        max_steps=args.max_steps,
        seed=args.seed,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=args.gradient_checkpointing,
        save_strategy="no",
        report_to="none",
        logging_steps=1,
        disable_tqdm=True,
        # Every wait of TRL's on the server has a deadline shorter than the demo's own.
        vllm_server_timeout=60,
        request_timeout=60,
        heartbeat_stale_after_s=120,
        weight_sync_timeout=120,
    )


def lora_config():
    from peft import LoraConfig

    return LoraConfig(
        r=TRAIN.lora_r,
        lora_alpha=TRAIN.lora_alpha,  # pyright: ignore[reportArgumentType]  # PEFT annotates int; the scale alpha/r takes any number
        lora_dropout=0.0,
        target_modules=list(LORA_TARGETS),
        task_type="CAUSAL_LM",
    )


def step_recorder(path: Path, budget_s: float):
    """A TrainerCallback writing one line per step to `path` and stopping training at the budget."""
    from transformers import TrainerCallback

    class StepRecorder(TrainerCallback):
        def __init__(self) -> None:
            self.trainer: Any = None
            self.started: float | None = None
            self.last_step_s = 0.0

        def on_train_begin(self, args, state, control, **kwargs):
            self.started = time.monotonic()

        def elapsed(self) -> float:
            """Seconds since training began (TRL's train begin: its first sync and the worker's start)."""
            return time.monotonic() - self.started if self.started is not None else 0.0

        def on_step_end(self, args, state, control, **kwargs):
            if self.elapsed() >= budget_s:
                control.should_training_stop = True

        def on_train_end(self, args, state, control, **kwargs):
            worker = getattr(self.trainer, "rollout_worker", None)
            for queue in (getattr(worker, "rollout_buffer", None), getattr(worker, "metrics_queue", None)):
                if queue is not None:
                    threading.Thread(target=drain, args=(queue,), name="drain-rollouts", daemon=True).start()

        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = logs or {}
            if "ratio" not in logs:  # not a training step's log (the end-of-training summary)
                return
            line = {
                "step": state.global_step,
                "elapsed_s": round(self.elapsed(), 3),
                "version": getattr(self.trainer, "model_version", None),
                **{key: logs[key] for key in LOGGED if logs.get(key) is not None},
            }
            self.last_step_s = line["elapsed_s"]
            with path.open("a") as fh:
                fh.write(json.dumps(line) + "\n")

    return StepRecorder()


def drain(queue, limit_s: float = 30.0) -> None:
    """Read and drop what TRL's rollout worker still sends once training has ended.

    The worker's process puts samples and metrics into multiprocessing queues; at exit it
    waits until their feeder threads have written everything into the pipes, which never
    happens while the trainer, done, reads nothing: TRL then waits 15 s and terminates it.
    Reading them until they stay empty lets it exit at once (none of it is trained on)."""
    import queue as queues

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            queue.get(timeout=1.0)
        except queues.Empty:
            return
        except (OSError, EOFError, ValueError):  # the queue was closed under us
            return


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    from rollwire.demo import trl_cpu

    torch.set_num_threads(args.threads)
    if trl_cpu.install():
        print("no GPU here: TRL's GPU-only parts run on rollwire.demo.trl_cpu's CPU stand-ins", flush=True)
    from trl.experimental.async_grpo.async_grpo_trainer import AsyncGRPOTrainer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "steps.jsonl").unlink(missing_ok=True)
    (out / "summary.json").unlink(missing_ok=True)
    recorder = step_recorder(out / "steps.jsonl", args.budget_s)
    trainer = AsyncGRPOTrainer(
        model=str(Path(args.model).resolve()),
        reward_funcs=exact_match_reward,
        args=trainer_config(args),
        train_dataset=train_dataset(args.seed),
        peft_config=lora_config(),
        callbacks=[recorder],
    )
    recorder.trainer = trainer
    if not trainer._lora_sync:  # pyright: ignore[reportAttributeAccessIssue]  # TRL's decision, read not changed
        print("TRL chose merged-weight sync (NCCL): the server did not offer adapter loading", file=sys.stderr)
        return 2
    trainer.train()
    summary = {
        "steps": trainer.state.global_step,
        "last_version": trainer.model_version,
        "train_s": round(recorder.last_step_s, 1),
        "lora_name": trainer._lora_name,  # pyright: ignore[reportAttributeAccessIssue]
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"trained {summary['steps']} steps; TRL loaded versions 1..{summary['last_version']}", flush=True)
    return 0


if __name__ == "__main__":
    # Run through the module's import name, not as __main__: TRL pickles the reward function for its
    # spawned worker by module and name, and `rollwire.demo.trl_trainer` is importable there.
    from rollwire.demo.trl_trainer import main as _main

    sys.exit(_main())
