"""TRL's GRPOTrainer beside rollwire's own stack: same taught model, task, held-out set, settings.

The peer is Hugging Face TRL (`pip install -e '.[model,bench]' -c constraints.txt`, trl 1.16.0): `GRPOTrainer` on the
tiny model taught the addition task to a partial skill (rollwire.demo.teach), in a process started
for each run as a user starts a training script (cold, as each run's `rollwire learner` is), on the
training split of rollwire's task, rewarded by rollwire's own `exact_match`. rollwire
is the local stack the demo runs (`--replicas`, default rollwire.demo.stack.LOCAL_REPLICAS = 1
transformers replica with 1 torch thread, sending whole groups, behind one proxy; `rollwire
learner` with 1 thread; on the cores the demo gives them, rollwire.demo.stack.local_placement,
or on any core with the system suffix @anywhere), started as bench/async_vs_sync.py starts it, in its synchronous
(max_staleness 0) and asynchronous (max_staleness 1) modes. The systems alternate per
repeat (the order reverses every other repeat), each run for a fixed training budget.
The third system, `trl-async@rollwire`, is `make demo-trl` (rollwire.demo.trl's pieces): TRL
1.16's AsyncGRPOTrainer, unmodified, in a process of its own with the rollout worker it spawns,
trained through the proxy's HTTP door with 2 replicas (a stack started for each run: TRL names
its versions from v1 on every run), with the demo's settings, which are the learner's (the same
as above; max_staleness 1); its versions are read back from the proxy's spool and scored as
the others'.

Shared settings: n = 8 completions per prompt, 8 groups per optimiser step, AdamW lr 1e-3
(constant, no weight decay, gradients clipped at norm 1), LoRA r 8 / alpha 16 / no dropout on
every linear layer, 8 new tokens, temperature 1 with top-k and top-p off, no KL term,
advantages normalised by the group's reward std, loss averaged over the step's completion
tokens (TRL's "dapo", as rollwire's "clipped"), clip 0.2 / 0.28 (TRL samples and trains on
the same weights once, so its ratio is 1 and the clip never acts). TRL's CPU-hostile defaults
are off (bf16, gradient checkpointing); its prompts get no special tokens (the char tokenizer
adds none, checked below), as rollwire's engine adds none. TRL runs in one process (see
Threads); rollwire's replicas and learner keep 1 torch thread each. Differences that stay: rollwire drops groups whose rewards are all equal (no advantage) before the batch,
so its 8 groups per step all carry signal, while TRL trains on the 8 groups it sampled,
zero-advantage ones included; TRL divides by the unbiased group std + 1e-4, rollwire by the
population std + 1e-6.
Threads: TRL gets 1 torch thread by default (`--trl-threads`). On this shared 2-core machine
under load, 2 threads made its steps 5-13x slower than 1 (0.6-1.6 s against 0.12-0.14 s, the
two threads spinning for each other), the trap FACTS records for several processes.

Timing, the same for both: a training clock that starts when the first rollout is requested
(TRL: `on_train_begin`; rollwire: the learner's start-of-training, after its "before" score)
and holds no held-out scoring. Neither system scores anything during the run: TRL's
callback copies the LoRA weights after every optimiser step with its clock paused, rollwire's
proxy keeps every pushed version in its spool (`spool.keep_versions` raised: it only evicts
less). After the run, every version of both is scored by one in-process scorer: greedy
decoding, 8 new tokens, exact match, on the 50 held-out prompts async_vs_sync uses. Time to
target is the clock at the first optimiser step whose weights score >= 0.9.
Figures per run: groups generated per second (rollwire: scored by the replicas and the
learner, before the buffer's drops), trained per second, trained with non-zero advantage per
second, seconds to target, final accuracy; TRL's split of step time into generation,
scoring and training; rollwire's wait/train/push phases and CPU seconds of each process.
Run: .venv/bin/python bench/peer_trl.py [--repeats 2] [--budget-s 30] [--seeds K] (K training seeds: each
repeat trains every system with the same seed, so the repeats also sample learning trajectories)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import resource
import shutil
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import async_vs_sync as avs
from common import WORK, cpu_seconds, spread, stop_all, write_result

from rollwire.demo.stack import LOCAL_REPLICAS, WHOLE_GROUPS, Placement, local_placement, pin
from rollwire.learner.config import LORA_TARGETS
from rollwire.learner.tasks.rewards import exact_match
from rollwire.learner.tasks.task import Example, addition_examples, eval_subset

TARGET, EVAL_SIZE, SEED = avs.TARGET, avs.EVAL_SIZE, avs.SEED
N, GROUPS_PER_STEP, LR, LORA_R, LORA_ALPHA, MAX_NEW_TOKENS, TEMPERATURE = 8, 8, 1e-3, 8, 16.0, 8, 1.0
TRL_THREADS = 1  # see Threads above; --trl-threads
KEEP_ALL = "buffer.keep_zero_variance=true"
"""Train on every sampled group, zero-advantage ones included, as TRL does."""
ROLLWIRE_MODES: dict[str, tuple[int, tuple[str, ...]]] = {
    "rollwire-sync": (0, ()),
    "rollwire-async": (1, ()),
    "rollwire-async-all": (1, (KEEP_ALL,)),
}
"""name -> (buffer.max_staleness, more learner settings). `-all` trains on every group, zero
advantage included, as TRL does: a step then needs half the rollouts (about half the groups
of this task have equal rewards), and those groups add no gradient, only tokens to the mean."""
ANYWHERE = "@anywhere"
"""A rollwire system with this suffix runs with no placement: every process on any core."""
ALL_CORES = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()
SPOOL = WORK / "peer-trl-spool"


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, target_modules=list(LORA_TARGETS), lora_dropout=0.0, bias="none")  # pyright: ignore[reportArgumentType]  # the library's annotation is narrower than what it accepts


# ---------------------------------------------------------------- held-out scoring


class Scorer:
    """Greedy held-out accuracy of LoRA weights on the taught model, in this process."""

    def __init__(self, model_dir: Path) -> None:
        import torch
        from peft import get_peft_model
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.examples = eval_subset(addition_examples(0.1)[1], EVAL_SIZE, SEED)  # the learner's held-out subset
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model = get_peft_model(base, lora_config()).eval()
        batch = self.tokenizer(
            [e.prompt for e in self.examples], add_special_tokens=False, padding=True, return_tensors="pt"
        )  # left padding (the tokenizer's side)
        self.ids, self.mask = batch.input_ids, batch.attention_mask

    def accuracy(self, state: dict) -> float:
        import torch
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(self.model, state)
        if getattr(result, "unexpected_keys", None):
            raise ValueError(f"adapter tensors the scorer's model lacks: {result.unexpected_keys[:3]}")
        with torch.no_grad():
            out = self.model.generate(
                input_ids=self.ids,
                attention_mask=self.mask,
                max_new_tokens=MAX_NEW_TOKENS,
                do_sample=False,
                top_k=None,
                top_p=None,
                pad_token_id=self.tokenizer.pad_token_id,
                eos_token_id=self.tokenizer.eos_token_id,
            )
        texts = self.tokenizer.batch_decode(out[:, self.ids.shape[1] :], skip_special_tokens=True)
        return sum(exact_match(t, e) for t, e in zip(texts, self.examples, strict=True)) / len(self.examples)

    def curve(self, points: list[tuple[float, dict]]) -> list[tuple[float, float]]:
        """[(seconds, weights)] -> [(seconds, accuracy)]."""
        return [(t, self.accuracy(state)) for t, state in points]


def to_target(curve: list[tuple[float, float]]) -> tuple[float | None, int | None]:
    """(seconds, optimiser steps) until the first scored weights at or above TARGET; curve[i] is after step i."""
    return next(((t, i) for i, (t, acc) in enumerate(curve) if acc >= TARGET), (None, None))


# ---------------------------------------------------------------- TRL


def trl_dataset():
    from datasets import Dataset  # pyright: ignore[reportMissingImports]  # the bench extra: pip install -e .[bench]

    train = addition_examples(0.1)[0]  # the training split: no held-out prompt is ever sampled
    return Dataset.from_dict({"prompt": [e.prompt for e in train], "answer": [e.answer for e in train]})


def exact_match_reward(prompts, completions, answer, **_):
    """rollwire's exact_match reward in TRL's reward-function shape (one float per completion)."""
    return [exact_match(c, Example(0, p, a)) for p, c, a in zip(prompts, completions, answer, strict=True)]


def run_trl(
    model_dir: Path, name: str, budget_s: float, max_steps: int = 0, seed: int = SEED
) -> tuple[dict, list[tuple[float, dict]]]:
    """One GRPOTrainer run of `budget_s` training seconds (or `max_steps` steps), trained with `seed`."""
    import torch
    from peft import get_peft_model_state_dict
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer  # pyright: ignore[reportMissingImports, reportPrivateImportUsage]  # the bench extra

    torch.set_num_threads(TRL_THREADS)
    out = WORK / "peer-trl" / name
    shutil.rmtree(out, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    probe = "07+45="
    assert tokenizer(text=[probe])["input_ids"][0] == tokenizer(probe, add_special_tokens=False)["input_ids"], (
        "TRL would add special tokens to the prompts"
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    args = GRPOConfig(
        output_dir=str(out),
        report_to="none",
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=GROUPS_PER_STEP * N,  # completions, not prompts
        gradient_accumulation_steps=1,
        num_generations=N,
        max_completion_length=MAX_NEW_TOKENS,
        temperature=TEMPERATURE,
        top_k=0,
        top_p=1.0,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        beta=0.0,
        loss_type="dapo",
        scale_rewards="group",
        epsilon=0.2,
        epsilon_high=0.28,
        num_iterations=1,
        max_steps=max_steps or 100_000,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_pin_memory=False,
        seed=seed,
    )
    clock = BudgetClock(budget_s if not max_steps else 0.0)

    class Timed(GRPOTrainer):
        def _generate(self, prompts):
            with clock.timed("generate"):
                return super()._generate(prompts)

        def _generate_and_score_completions(self, inputs):
            with clock.timed("rollout"):
                return super()._generate_and_score_completions(inputs)

    class Callback(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            clock.begin()

        def on_step_end(self, args, state, control, model=None, **kw):
            seconds = clock.now()
            with clock.paused():  # copying the weights for later scoring is not TRL's work
                weights = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
            clock.points.append((seconds, weights))
            clock.steps = state.global_step
            if clock.budget_s and seconds >= clock.budget_s:
                control.should_training_stop = True

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "frac_reward_zero_std" in logs:
                clock.logs.append(dict(logs))

    trainer = Timed(
        model=model,
        reward_funcs=exact_match_reward,  # pyright: ignore[reportArgumentType]  # the library's annotation is narrower than what it accepts
        args=args,
        train_dataset=trl_dataset(),
        processing_class=tokenizer,
        peft_config=lora_config(),
        callbacks=[Callback()],
    )
    trainer.remove_callback(PrinterCallback)  # disable_tqdm prints every log line otherwise
    start_weights = {k: v.detach().clone() for k, v in get_peft_model_state_dict(trainer.model).items()}
    cpu0 = _self_cpu()
    trainer.train()
    cpu = _self_cpu() - cpu0
    steps, wall = clock.steps, clock.points[-1][0]
    zero = [log["frac_reward_zero_std"] for log in clock.logs][:steps]
    groups = steps * GROUPS_PER_STEP
    informative = sum((1 - z) * GROUPS_PER_STEP for z in zero)
    result = {
        "steps": steps,
        "training_seconds": wall,
        "generated_groups_per_s": groups / wall,
        "trained_groups_per_s": groups / wall,
        "informative_groups_per_s": informative / wall,
        "zero_advantage_share": 1 - informative / groups,
        "step_s": wall / steps,
        "phase_s_per_step": {
            "generate": clock.phase["generate"] / steps,
            "score_rewards_advantages": (clock.phase["rollout"] - clock.phase["generate"]) / steps,
            "train_and_rest": (wall - clock.phase["rollout"]) / steps,
        },
        "paused_s": clock.paused_s,
        "cpu_s": {"trl": cpu},
        "rollout_accuracy": [log.get("rewards/exact_match_reward/mean") for log in clock.logs][:steps],
    }
    return result, [(0.0, start_weights), *clock.points]


def run_trl_fresh(model_dir: Path, name: str, budget_s: float, seed: int) -> tuple[dict, list[tuple[float, dict]]]:
    """`run_trl` in a process of its own, started for this run, as a user starts a training
    script: torch, the model and the trainer start cold, as rollwire's learner does (a fresh
    `rollwire learner` process each run; only the long-running replicas and proxy are warm)."""
    from safetensors.torch import load

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        result, points = pool.apply(_run_trl_in_child, (model_dir, name, budget_s, seed, TRL_THREADS))
    return result, [(t, load(weights)) for t, weights in points]


def _run_trl_in_child(model_dir: Path, name: str, budget_s: float, seed: int, threads: int):
    """run_trl's result, each point's weights as safetensors bytes: tensors sent back as they are
    travel as shared memory, one file descriptor each, which a long run's points exhaust."""
    from safetensors.torch import save

    global TRL_THREADS
    TRL_THREADS = threads
    result, points = run_trl(model_dir, name, budget_s, seed=seed)
    return result, [(t, save(weights)) for t, weights in points]


class BudgetClock:
    """Training seconds since `begin`, less the paused spans; what the TRL callbacks record."""

    def __init__(self, budget_s: float) -> None:
        self.budget_s, self.started, self.steps = budget_s, 0.0, 0
        self.points: list[tuple[float, dict]] = []
        self.logs: list[dict] = []
        self.phase = {"generate": 0.0, "rollout": 0.0, "paused": 0.0}

    @property
    def paused_s(self) -> float:
        return self.phase["paused"]

    def begin(self) -> None:
        self.started, self.phase["paused"] = time.perf_counter(), 0.0

    def now(self) -> float:
        return time.perf_counter() - self.started - self.paused_s

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Adds the seconds the block takes to `phase` ("paused": `now` leaves them out)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.phase[phase] += time.perf_counter() - started

    def paused(self) -> contextlib.AbstractContextManager[None]:
        return self.timed("paused")


def _self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


# ---------------------------------------------------------------- rollwire


def run_rollwire(
    stack: list,
    model_dir: Path,
    name: str,
    staleness: int,
    budget_s: float,
    *settings: str,
    placement: Placement = Placement(),
):
    """One `rollwire learner` run through async_vs_sync.learn, with no Watcher (no scoring in the run)."""
    from safetensors.torch import load_file

    procs = {f"replica-{i}": p.proc.pid for i, p in enumerate(stack[:-1])} | {"proxy": stack[-1].proc.pid}
    cpu0 = {k: cpu_seconds(pid) for k, pid in procs.items()}
    learner0 = _children_cpu()
    run, _ = avs.learn(
        stack[-1].target,
        model_dir,
        name,
        staleness,
        f"max_seconds={budget_s}",
        "eval.at_end=false",
        *settings,
        watch=False,
        cpus=placement.learner,
    )
    cpu = {k: cpu_seconds(pid) - cpu0[k] for k, pid in procs.items()}
    cpu["learner_whole_process"] = _children_cpu() - learner0  # start-up (imports, model load) included
    summary = json.loads((run / "summary.json").read_text())
    steps = [json.loads(line) for line in (run / "steps.jsonl").read_text().splitlines()]
    before = next(e for e in summary["evals"] if e["label"] == "before")
    started = before["elapsed_s"]  # training starts once the starting policy is scored (as async_vs_sync)
    last = steps[-1]
    wall = last["elapsed_s"] - started
    groups = last["groups"]
    scored = groups["trained"] + groups["buffered"] + sum(v for k, v in groups["dropped"].items() if k != "shutdown")
    spool = SPOOL / name

    def weights(version: int) -> dict:
        return load_file(spool / f"{version}.safetensors")

    points = [(0.0, weights(before["version"]))] + [(s["elapsed_s"] - started, weights(s["version"])) for s in steps]
    trained = groups["trained"]
    keeps_all = KEEP_ALL in settings
    result = {
        "steps": len(steps),
        "training_seconds": wall,
        "generated_groups_per_s": scored / wall,
        "trained_groups_per_s": trained / wall,
        # Zero-advantage groups are dropped before the batch, unless this mode keeps them: the
        # learner's records then do not say how many of the trained groups had a gradient.
        "informative_groups_per_s": None if keeps_all else trained / wall,
        "zero_advantage_share": None if keeps_all else groups["dropped"].get("zero_variance", 0) / scored,
        "step_s": wall / len(steps),
        "phase_s_per_step": {
            k: statistics.fmean(s["phase_seconds"].get(k, 0.0) for s in steps) for k in ("wait", "train", "push")
        },
        "dropped": groups["dropped"],
        "staleness_mean": summary["staleness_mean"],
        "accuracy_before_engine": summary["accuracy_before"],  # the learner's own score, through the replicas
        "cpu_s": cpu,
        "rollout_accuracy": [s.get("rollout_accuracy") for s in steps],
    }
    return result, points


# ---------------------------------------------------------------- TRL's AsyncGRPOTrainer on rollwire


TRL_ASYNC = "trl-async@rollwire"
"""`make demo-trl`'s trainer (TRL 1.16 AsyncGRPOTrainer, unmodified) through the proxy's HTTP door."""
TRL_ASYNC_REPLICAS = 2  # make demo-trl's (rollwire.demo.trl.REPLICAS)
TRL_ASYNC_WORK = WORK / "peer-trl-async"
TRL_ASYNC_STALENESS = 4  # the demo's: TRL's own default max_staleness (rollwire.demo.trl_trainer)


def run_trl_async(model_dir: Path, name: str, budget_s: float, seed: int) -> tuple[dict, list[tuple[float, dict]]]:
    """One run of `make demo-trl`'s pieces: a stack of its own (2 replicas behind a proxy
    serving the HTTP door, the demo's placement, a fresh spool that keeps every version, as TRL
    names its versions from v1 on every run), then rollwire.demo.trl_trainer (the dataset, reward
    and settings of make demo-trl, which are the learner's; `seed` orders the data and seeds TRL)
    for `budget_s` seconds from TRL's train begin, which spawns its rollout worker. Nothing is
    scored during the run: every version TRL loaded is read back from the proxy's spool.
    Generated groups are the door's answered `/v1/completions` (one sample each, as TRL's
    worker asks) until the last step, over n."""
    from safetensors.torch import load_file

    from rollwire.demo.trl import ADAPTER, follow, proxy_figures, start_door_stack, start_trainer, stop_trainer

    work = TRL_ASYNC_WORK / name
    shutil.rmtree(work, ignore_errors=True)
    out = work / "trl"
    lora_root = out / ".vllm_lora"  # AsyncGRPOTrainer._lora_dir
    lora_root.mkdir(parents=True)
    spool = work / "spool"
    placement = local_placement(TRL_ASYNC_REPLICAS)
    stack = start_door_stack(
        model_dir, work, TRL_ASYNC_REPLICAS, lora_root, placement, f"spool.dir={spool}", "spool.keep_versions=1000000"
    )
    trainer = None
    try:
        procs = {f"replica-{i}": r.proc.pid for i, r in enumerate(stack.replicas)} | {"proxy": stack.proxy.proc.pid}
        cpu0 = {k: cpu_seconds(pid) for k, pid in procs.items()}
        trainer0 = _children_cpu()
        samples: list[tuple[int, int]] = []  # (step, door's answered completions when it was seen)

        def count(step: dict) -> None:
            samples.append((step["step"], _answered(proxy_figures(stack.proxy)["http"].get("/v1/completions"))))

        trainer = start_trainer(work, out, stack.proxy.http_url, model_dir, budget_s, 100_000, placement.learner, seed)
        code = follow(
            trainer, out / "steps.jsonl", budget_s, budget_s + 180, progress=False, on_step=count, interval_s=0.2
        )
        if code != 0:
            log = (work / "trainer.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the TRL trainer {'timed out' if code is None else f'exited {code}'}:\n{log}")
        cpu = {k: cpu_seconds(pid) - cpu0[k] for k, pid in procs.items()}
        cpu["trainer_and_worker"] = _children_cpu() - trainer0  # TRL's start-up included
        door = proxy_figures(stack.proxy)
    finally:
        if trainer is not None:
            stop_trainer(trainer)
        stack.stop()
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines() if line]
    last = steps[-1]
    wall = last["elapsed_s"]
    generated = next((n for step, n in reversed(samples) if step == last["step"]), samples[-1][1] if samples else 0)

    def weights(version: int) -> dict:
        return load_file(spool / ADAPTER / f"{version}.safetensors")

    points = [(0.0, weights(1))] + [(s["elapsed_s"], weights(s["version"])) for s in steps]

    def mean(key: str) -> float | None:
        values = [s[key] for s in steps if s.get(key) is not None]
        return statistics.fmean(values) if values else None

    result = {
        "steps": len(steps),
        "training_seconds": wall,
        "generated_groups_per_s": generated / N / wall,
        "trained_groups_per_s": len(steps) * GROUPS_PER_STEP / wall,
        "informative_groups_per_s": None,  # TRL trains every group; its logs here do not count the zero-advantage ones
        "zero_advantage_share": None,
        "step_s": wall / len(steps),
        "first_step_s": steps[0]["elapsed_s"],  # train begin to step 1: the worker's spawn, the first rollouts
        "phase_s_per_step": {  # TRL's own: a step waits for rollouts, trains, then syncs the weights
            "rollout_wait": mean("perf/rollout_wait_s"),
            "fwd_bwd": mean("perf/fwd_bwd_s"),
            "weight_sync": mean("perf/weight_sync_s"),
            "weight_sync_pause": mean("perf/weight_sync_pause_s"),
            "weight_sync_save": mean("perf/weight_sync_transfer_s"),
            "step": mean("perf/step_s"),
        },
        "rollout_s": mean("rollout/duration_s"),  # one sample's request, as TRL's worker saw it
        "rollout_tokens_per_s": mean("rollout/generated_tok_s"),
        "rollout_queue_size": mean("sample/rollout_queue_size"),
        "door": {
            "mean_s": {route: r["mean_s"] for route, r in door["http"].items()},
            "requests": {route: r["requests"] for route, r in door["http"].items()},
            "push_fanout_s": door["push_fanout_s"],
            "pushes": door["pushes"],
            "not_200": {route: r["not_200"] for route, r in door["http"].items() if r["not_200"]},
        },
        "staleness_mean": mean("sample/staleness_mean"),
        "dropped_stale_samples": last.get("sample/dropped_stale_total"),
        "ratio_step1": steps[0].get("ratio"),
        "cpu_s": cpu,
        "rollout_accuracy": [s.get("reward") for s in steps],
    }
    return result, points


def _answered(route: dict | None) -> int:
    """Requests of one door route answered 200 (proxy_figures' counts)."""
    return route["requests"] - sum(route["not_200"].values()) if route else 0


# ---------------------------------------------------------------- main


def main() -> None:
    global TRL_THREADS
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=30.0, help="training seconds of each run")
    ap.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="training seeds, cycled through the repeats (repeat i trains every system with seed i mod SEEDS): one "
        "seed gives each system one learning trajectory, so its repeats measure only timing noise",
    )
    ap.add_argument(
        "--systems",
        default="trl,rollwire-sync,rollwire-async",
        help=f"comma-separated, in run order: trl, {TRL_ASYNC}, {', '.join(ROLLWIRE_MODES)}; a rollwire one with the suffix "
        f"{ANYWHERE} runs its processes on any core (the demo's placement is rollwire.demo.stack.local_placement)",
    )
    ap.add_argument("--replicas", type=int, default=LOCAL_REPLICAS, help="rollwire's replicas (default: the demo's)")
    ap.add_argument("--trl-threads", type=int, default=TRL_THREADS, help="torch threads of TRL (and of the scorer)")
    ap.add_argument(
        "--result", default="peer_trl", help="results file: bench/results/RESULT.json (default %(default)s)"
    )
    args = ap.parse_args()
    TRL_THREADS = args.trl_threads
    import torch

    from rollwire.runtime.logs import setup_logging

    setup_logging("bench", "error")
    systems = args.systems.split(",")
    unknown = {s.removesuffix(ANYWHERE) for s in systems} - {"trl", TRL_ASYNC, *ROLLWIRE_MODES}
    if unknown:
        ap.error(f"unknown systems {sorted(unknown)}")
    if args.seeds < 1 or args.repeats < 1:
        ap.error("--seeds and --repeats must be at least 1")
    model_dir = avs.taught_model()
    placement = local_placement(args.replicas)
    torch.set_num_threads(TRL_THREADS)
    scorer = Scorer(model_dir)
    shutil.rmtree(SPOOL, ignore_errors=True)
    stack = (
        avs.start_stack(
            model_dir,
            f"spool.dir={SPOOL}",
            "spool.keep_versions=1000000",
            replicas=args.replicas,
            generator_args=WHOLE_GROUPS,
            placement=placement,
        )
        if any(s.removesuffix(ANYWHERE) in ROLLWIRE_MODES for s in systems)
        else []
    )
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    load = {"loadavg_start": _loadavg()}
    try:
        if stack:
            avs.learn(
                stack[-1].target,
                model_dir,
                "peer-warmup",
                1,
                "max_steps=3",
                "eval.at_end=false",
                watch=False,
                cpus=placement.learner,
            )
        for index in range(args.repeats):
            seed = SEED + index % args.seeds
            for system in systems if index % 2 == 0 else list(reversed(systems)):
                if system == "trl":
                    result, points = run_trl_fresh(model_dir, f"trl-{index}", args.budget_s, seed)
                elif system == TRL_ASYNC:
                    result, points = run_trl_async(model_dir, f"run-{index}", args.budget_s, seed)
                else:
                    staleness, settings = ROLLWIRE_MODES[system.removesuffix(ANYWHERE)]
                    where = Placement() if system.endswith(ANYWHERE) else placement
                    for service, cores in zip(stack, (*[where.replicas] * (len(stack) - 1), where.proxy), strict=True):
                        pin(service.proc.pid, cores or ALL_CORES)
                    result, points = run_rollwire(
                        stack,
                        model_dir,
                        f"peer-{system}-{index}".replace("@", "-"),
                        staleness,
                        args.budget_s,
                        f"seed={seed}",
                        *settings,
                        placement=where,
                    )
                result["seed"] = seed
                torch.set_num_threads(TRL_THREADS)
                scoring = time.perf_counter()
                curve = scorer.curve(points)
                seconds, steps = to_target(curve)
                result.update(
                    accuracy_before=curve[0][1],
                    accuracy_after=curve[-1][1],
                    seconds_to_target=seconds,
                    steps_to_target=steps,
                    curve=[{"seconds": round(t, 3), "accuracy": a} for t, a in curve],
                    scoring_s=time.perf_counter() - scoring,
                    loadavg_after=_loadavg(),
                )
                runs[system].append(result)
                print(
                    f"{system:14s} #{index}: {result['generated_groups_per_s']:6.2f} gen/s "
                    f"{result['trained_groups_per_s']:6.2f} trained/s "
                    f"{_fmt(result['informative_groups_per_s'], 'n/a')} informative/s, {result['steps']} steps, "
                    f"accuracy {result['accuracy_before']:.2f} -> {result['accuracy_after']:.2f}, "
                    f"target {TARGET} after {_fmt(seconds)} s ({steps} steps), load {result['loadavg_after']}",
                    flush=True,
                )
    finally:
        stop_all(reversed(stack))
    load["loadavg_end"] = _loadavg()
    figures = (
        "generated_groups_per_s",
        "trained_groups_per_s",
        "informative_groups_per_s",
        "seconds_to_target",
        "steps_to_target",
        "accuracy_after",
        "step_s",
        "zero_advantage_share",
    )
    per_system = {
        s: {k: spread(vals) if (vals := [r[k] for r in rs if r[k] is not None]) else None for k in figures}
        | {"reached_target": f"{sum(r['seconds_to_target'] is not None for r in rs)}/{len(rs)}"}
        for s, rs in runs.items()
        if rs
    }
    print_table(per_system)
    pairs = pair_ratios(runs)
    for name, ratios in pairs.items():
        print(f"{name}: " + ", ".join(f"{r:.2f}" if r is not None else "-" for r in ratios))
    write_result(
        args.result,
        f".venv/bin/python bench/peer_trl.py --repeats {args.repeats} --budget-s {args.budget_s:g}"
        + (f" --systems {args.systems}" if args.systems != ap.get_default("systems") else "")
        + (f" --trl-threads {TRL_THREADS}" if ap.get_default("trl_threads") != TRL_THREADS else "")
        + (f" --seeds {args.seeds}" if args.seeds != 1 else "")
        + (f" --result {args.result}" if args.result != ap.get_default("result") else ""),
        {
            "workload": {
                "model": "tiny Llama taught the addition task (rollwire.demo.teach)",
                "budget_s": args.budget_s,
                "repeats": args.repeats,
                "held_out_seed": SEED,
                "training_seeds": sorted({SEED + i % args.seeds for i in range(args.repeats)}),
                "target_accuracy": TARGET,
                "eval_size": EVAL_SIZE,
                "n": N,
                "groups_per_step": GROUPS_PER_STEP,
                "lr": LR,
                "lora": {"r": LORA_R, "alpha": LORA_ALPHA, "targets": LORA_TARGETS},
                "max_new_tokens": MAX_NEW_TOKENS,
                "temperature": TEMPERATURE,
                "rollwire_replicas": args.replicas,
                "rollwire_generator_args": list(WHOLE_GROUPS),
                "rollwire_cores": {
                    "learner": sorted(placement.learner),
                    "replicas": sorted(placement.replicas),
                    "proxy": sorted(placement.proxy),
                },
                "threads": {
                    "trl": TRL_THREADS,
                    "rollwire": "1 per replica and 1 for the learner",
                    TRL_ASYNC: "1 for the trainer and 1 for its rollout worker, 1 per replica",
                },
                TRL_ASYNC: {
                    "replicas": TRL_ASYNC_REPLICAS,
                    "cores": {
                        "trainer_and_worker": sorted(local_placement(TRL_ASYNC_REPLICAS).learner),
                        "replicas_and_proxy": sorted(local_placement(TRL_ASYNC_REPLICAS).replicas),
                    },
                    "max_staleness": TRL_ASYNC_STALENESS,
                },
                "systems": systems,
                "versions": _versions(),
            },
            "load": load,
            "per_system": per_system,
            "pair_ratios": pairs,
            "runs": runs,
        },
    )


def pair_ratios(runs: dict[str, list[dict]]) -> dict[str, list[float | None]]:
    """Per repeat (same seed, adjacent in time), each rollwire system over TRL: generated
    groups/s and seconds to target (None where either missed the target)."""
    out: dict[str, list[float | None]] = {}
    for system, rs in runs.items():
        if system == "trl" or not runs.get("trl"):
            continue
        pairs = list(zip(rs, runs["trl"], strict=False))
        out[f"{system}/trl generated groups/s"] = [
            r["generated_groups_per_s"] / t["generated_groups_per_s"] for r, t in pairs
        ]
        out[f"{system}/trl seconds to target"] = [
            r["seconds_to_target"] / t["seconds_to_target"]
            if r["seconds_to_target"] and t["seconds_to_target"]
            else None
            for r, t in pairs
        ]
    return out


def print_table(per_system: dict) -> None:
    def cell(figure: dict | None, digits: int = 1) -> str:
        if not figure:
            return "-"
        return f"{figure['median']:.{digits}f} [{figure['min']:.{digits}f}-{figure['max']:.{digits}f}]"

    head = (
        "system",
        "generated groups/s",
        "trained groups/s",
        "informative groups/s",
        "s to 90%",
        "steps to 90%",
        "reached",
        "final acc",
    )
    rows = [
        (
            s,
            cell(f["generated_groups_per_s"]),
            cell(f["trained_groups_per_s"]),
            cell(f["informative_groups_per_s"]),
            cell(f["seconds_to_target"]),
            cell(f["steps_to_target"], 0),
            f["reached_target"],
            cell(f["accuracy_after"], 2),
        )
        for s, f in per_system.items()
    ]
    widths = [max(len(str(r[i])) for r in (head, *rows)) for i in range(len(head))]
    for r in (head, *rows):
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)))
    print("median [min-max] over repeats")


def _fmt(value: float | None, none: str = "never") -> str:
    return none if value is None else f"{value:.1f}"


def _loadavg() -> list[float]:
    import os

    return [round(x, 2) for x in os.getloadavg()]


def _versions() -> dict:
    from importlib.metadata import version

    return {p: version(p) for p in ("trl", "transformers", "peft", "torch", "accelerate", "datasets")}


if __name__ == "__main__":
    main()
