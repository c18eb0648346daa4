"""Teach the tiny model the built-in task to a partial skill, by supervised training.

The teacher is deliberately imperfect: it writes the right sum with probability
`teacher_accuracy` and otherwise the carry-free sum (each column mod 10, as a student who
forgets to carry). Trained on that, the model learns both behaviours: it always answers
carry-free problems right, and on problems with a carry it produces the right answer only
some of the time, so greedy decoding is right on roughly a third of the held-out set while
sampling finds the right answer often. That is the room RL has: rewarding the right answer
moves the model from the teacher's mixture towards always carrying.

Invariants:
- only training-split prompts are taught (the held-out split is never seen);
- the build is a pure function of `TeachSpec` (seeded weights, seeded data order, fixed
  thread count); its folder carries `teach.json` with the spec's content key, and a folder
  whose key matches is reused instead of rebuilt. Bytes may differ across torch builds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from rollwire.demo.tiny_model import TinyModelSpec, save_tokenizer
from rollwire.learner.tasks.task import Example, addition_examples, carry_free_answer, eval_subset, is_correct
from rollwire.runtime.durable import atomic_dir

TEACH_FORMAT = 2
"""Bumped whenever the teaching code changes what it builds, so caches are rebuilt (2: the
tokenizer gained its chat template; the weights are the same)."""


@dataclass(frozen=True)
class TeachSpec:
    """Everything that decides the taught model; its hash is the cache key."""

    model: TinyModelSpec = field(default_factory=lambda: TinyModelSpec(max_position_embeddings=64))
    steps: int = 1000
    batch_size: int = 64
    lr: float = 2e-3
    warmup_steps: int = 50
    decay_fraction: float = 0.3
    """The last share of steps decays the learning rate linearly to zero."""
    clean_fraction: float = 0.5
    """The first share of steps is taught by an exact teacher (the model learns to carry)."""
    teacher_accuracy: float = 0.3
    """After that, the probability that the teacher writes the right sum (else the carry-free one)."""
    held_out_fraction: float = 0.1
    seed: int = 0
    threads: int = 1
    chain_turns: int = 0
    """0: the single-turn addition task; else chained addition over this many turns (learner/tasks/chain.py)."""

    def key(self) -> str:
        fields = dataclasses.asdict(self)
        if not self.chain_turns:  # the single-turn spec keeps the key it had before chains existed
            del fields["chain_turns"]
        blob = json.dumps({"format": TEACH_FORMAT, **fields}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def build_taught_model(out_dir: str | Path, spec: TeachSpec = TeachSpec(), log=print) -> Path:
    """The taught model in `out_dir`, built unless the folder already holds this spec's build."""
    out = Path(out_dir)
    if cached_key(out) == spec.key():
        return out
    started = time.monotonic()
    model, tokenizer, report = teach(spec, log)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_dir(out) as tmp:  # a crash mid-save never leaves a model that looks cached
        model.save_pretrained(tmp, safe_serialization=True)
        save_tokenizer(tokenizer, tmp)
        report.update(key=spec.key(), spec=dataclasses.asdict(spec), seconds=round(time.monotonic() - started, 1))
        (tmp / "teach.json").write_text(json.dumps(report, indent=2) + "\n")
    return out


def cached_key(folder: Path) -> str | None:
    try:
        return json.loads((folder / "teach.json").read_text()).get("key")
    except (OSError, ValueError):
        return None


def teach(spec: TeachSpec, log=print):
    """Run the supervised teaching; returns (model, tokenizer, report)."""
    import torch

    from rollwire.demo.tiny_model import new_tiny_model

    torch.set_num_threads(spec.threads)
    model, tokenizer = new_tiny_model(spec.model)
    train, held = task_examples(spec)
    vocab = tokenizer.get_vocab()
    encode = lambda text: [vocab[c] for c in text]  # noqa: E731 (char-level: one id per character)
    eos: int = tokenizer.eos_token_id  # pyright: ignore[reportAssignmentType]
    rng = random.Random(spec.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.98), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(spec, s))
    model.train()
    for step in range(1, spec.steps + 1):
        accuracy = 1.0 if step <= spec.clean_fraction * spec.steps else spec.teacher_accuracy
        batch = [teacher_example(spec, rng.choice(train), rng, accuracy) for _ in range(spec.batch_size)]
        ids, mask, labels = segment_tensors(batch, encode, eos)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == spec.steps:
            log(f"teach step {step}/{spec.steps} loss {loss.item():.3f}")
    model.eval()
    if spec.chain_turns:
        accuracy = greedy_chain_success(model, encode, tokenizer, eval_subset(held, 300, spec.seed))
    else:
        accuracy = greedy_accuracy(model, encode, tokenizer, eval_subset(held, 300, spec.seed))
    log(f"taught: greedy accuracy on 300 held-out problems {accuracy:.2f}")
    return model, tokenizer, {"greedy_accuracy_held_out": accuracy, "final_loss": round(loss.item(), 4)}


def lr_factor(spec: TeachSpec, step: int) -> float:
    """Linear warm-up, constant, then linear decay over the last `decay_fraction` of steps."""
    warm = min(1.0, (step + 1) / max(1, spec.warmup_steps))
    decay_steps = max(1.0, spec.decay_fraction * spec.steps)
    return warm * max(0.0, min(1.0, (spec.steps - step) / decay_steps))


def task_examples(spec: TeachSpec) -> tuple[list[Example], list[Example]]:
    """(train, held_out) of the task `spec` teaches."""
    if spec.chain_turns:
        from rollwire.learner.tasks.chain import chain_examples

        return chain_examples(spec.held_out_fraction)
    return addition_examples(spec.held_out_fraction)


def teacher_example(spec: TeachSpec, ex: Example, rng: random.Random, accuracy: float) -> list[tuple[str, bool]]:
    """The teacher's text for `ex` as (text, trained) segments; EOS follows each trained one."""
    if spec.chain_turns:
        from rollwire.learner.tasks.chain import from_example, teacher_segments

        return teacher_segments(from_example(ex), rng, accuracy)
    prompt, answer = teacher_pair(ex, rng, accuracy)
    return [(prompt, False), (answer, True)]


def segment_tensors(examples: list[list[tuple[str, bool]]], encode, eos_id: int):
    """Right-padded ids, attention mask and labels: the loss on trained segments and the EOS after each."""
    import torch

    rows = []
    for segments in examples:
        ids, trained = [], []
        for text, train in segments:
            part = encode(text) + ([eos_id] if train else [])
            ids += part
            trained += [train] * len(part)
        rows.append((ids, trained))
    width = max(len(ids) for ids, _ in rows)
    ids_t = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids_t)
    labels = torch.full_like(ids_t, -100)
    for i, (ids, trained) in enumerate(rows):
        ids_t[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = 1
        labels[i, : len(ids)] = torch.tensor([t if k else -100 for t, k in zip(ids, trained, strict=True)])
    return ids_t, mask, labels


def teacher_pair(ex: Example, rng: random.Random, accuracy: float) -> tuple[str, str]:
    """(prompt, what the imperfect teacher answers)."""
    right = rng.random() < accuracy
    return ex.prompt, ex.answer if right else carry_free_answer(ex.meta["a"], ex.meta["b"])


def greedy_completions(model, tokenizer, prompts: list[list[int]], max_new_tokens: int) -> list[str]:
    """The model's greedy completion of each prompt, decoded, in one left-padded batch.

    Left padding keeps every prompt's last token in the batch's last column, so each row's new
    tokens start at the same place and the batch decodes as the prompts would alone.
    """
    import torch

    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    return tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)


def greedy_accuracy(model, encode, tokenizer, examples: list[Example], max_new_tokens: int = 5) -> float:
    """Share of examples whose greedy completion is right (in-process, for the build report)."""
    texts = greedy_completions(model, tokenizer, [encode(e.prompt) for e in examples], max_new_tokens)
    return sum(is_correct(t, e.answer) for t, e in zip(texts, examples, strict=True)) / len(examples)


def greedy_chain_success(model, encode, tokenizer, examples: list[Example], max_new_tokens: int = 4) -> float:
    """Share of held-out episodes whose every turn the model answers right, greedily, in-process."""
    from rollwire.learner.tasks.chain import TURNS, from_example, question, read_answer

    chains = [from_example(e) for e in examples]
    histories = [encode(c.prompt) for c in chains]
    operands = [(c.a, c.b) for c in chains]
    alive = [True] * len(chains)
    for turn in range(TURNS):
        rows = [i for i, ok in enumerate(alive) if ok]
        if not rows:
            break
        texts = greedy_completions(model, tokenizer, [histories[i] for i in rows], max_new_tokens)
        for i, text in zip(rows, texts, strict=True):
            answer = read_answer(text)
            left, right = operands[i]
            if answer is None or answer != left + right:
                alive[i] = False
                continue
            if turn + 1 < TURNS:
                addend = chains[i].addends[turn]
                histories[i] += [*encode(f"{answer:03d}"), tokenizer.eos_token_id, *encode(question(answer, addend))]
                operands[i] = (answer, addend)
    return sum(alive) / len(chains)


def describe(folder: Path) -> str:
    """One line about a taught model folder, for logs."""
    report = json.loads((folder / "teach.json").read_text())
    acc = report.get("greedy_accuracy_held_out", math.nan)
    return f"{folder} (key {report['key']}, held-out greedy accuracy {acc:.2f}, built in {report['seconds']}s)"
