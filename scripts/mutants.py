"""`make mutants`: a mutation spot-check of the invariants the unit tier must guard (issue 53).

Each entry of MUTANTS names one invariant, the file that keeps it, a snippet of that file as it
is and the mutant that breaks the invariant, and the unit tests that must fail on the mutant.
The tree is copied once into a temporary folder (its tracked and unignored files); each mutant
is written into the copy, its tests run there (PYTHONPATH on the copy, no bytecode written, so
the next run never reads a stale one), and the original file is put back in the copy before
the next. The checkout itself is never written.

A mutant is caught when its tests fail; it survives when they pass. Exit status 0 only when
every mutant was caught and every snippet was found exactly once (a snippet that no longer
matches is reported as stale, and fails the check: update the entry with the code it guards).

    .venv/bin/python scripts/mutants.py            # every entry
    .venv/bin/python scripts/mutants.py -k bulk    # entries whose name contains "bulk"
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    name: str
    """The invariant the mutant breaks, as a sentence."""
    path: str
    original: str
    mutant: str
    tests: tuple[str, ...]
    """pytest node ids (relative to the root) that must fail on the mutant."""


MUTANTS = (
    # -- the four the unit tier did not guard before issue 53 --------------------------------------
    Mutant(
        "sizes: texts of 4-byte characters between cap/4 and cap/3 characters are refused",
        "server/rollwire/serving/sizes.py",
        "(4 * len(text) > cap and",
        "(3 * len(text) > cap and",
        (
            "tests/unit/generator/test_generator_convert.py::test_a_text_of_wide_characters_is_measured_in_bytes_at_every_length",
        ),
    ),
    Mutant(
        "trainer: a token one version staler than buffer.max_token_staleness never reaches the loss",
        "learner/rollwire/learner/train/trainer.py",
        "[float(version - v <= max_token_staleness) for v in sample.token_versions]",
        "[float(version - v <= max_token_staleness + 1) for v in sample.token_versions]",
        (
            "tests/unit/learner/test_learner_trainer.py::test_a_token_one_version_past_the_token_limit_never_reaches_the_loss",
        ),
    ),
    Mutant(
        "grpo: the log-ratio clamp keeps exp finite in float32",
        "learner/rollwire/learner/train/grpo.py",
        "LOG_RATIO_BOUND = 20.0",
        "LOG_RATIO_BOUND = 100.0",
        (
            "tests/unit/learner/test_grpo.py::test_the_log_ratio_clamp_keeps_every_ratio_and_its_report_finite_in_float32",
        ),
    ),
    Mutant(
        "bulk: an expired offer's token is refused",
        "server/rollwire/push/offers.py",
        "expected is None or expected.expires < self.clock():",
        "expected is None:",
        ("tests/unit/push/test_bulk_offers.py::test_a_token_opens_its_push_once_and_only_before_its_offer_expires",),
    ),
    # -- invariants the unit tier already guarded ----------------------------------------------------
    Mutant(
        "bulk: an offer's token opens its push once",
        "server/rollwire/push/offers.py",
        "expected = self._expected.pop(bytes(hello[len(wire.MAGIC) :]), None)",
        "expected = self._expected.get(bytes(hello[len(wire.MAGIC) :]), None)",
        ("tests/unit/push/test_bulk_offers.py",),
    ),
    Mutant(
        "bulk: a token binds the adapter's version",
        "client/rollwire/common/bulk.py",
        'text = f"rollwire-bulk\\0{manifest.name}\\0{manifest.version}\\0{manifest.sha256}\\0{index}"',
        'text = f"rollwire-bulk\\0{manifest.name}\\0{manifest.sha256}\\0{index}"',
        ("tests/unit/common/test_bulk_agreement.py",),
    ),
    Mutant(
        "bulk: an offer with a secret under 16 bytes is no offer",
        "client/rollwire/common/bulk.py",
        "len(offer.secret) >= 16",
        "len(offer.secret) >= 8",
        ("tests/unit/common/test_bulk_agreement.py",),
    ),
    Mutant(
        "sizes: a prompt of token ids is refused past max_prompt_tokens",
        "server/rollwire/serving/sizes.py",
        'elif kind == "token_ids" and len(request.token_ids.ids) > max_prompt_tokens:',
        'elif kind == "token_ids" and len(request.token_ids.ids) > max_prompt_tokens + 1:',
        (
            "tests/unit/generator/test_generator_convert.py::test_the_prompt_size_rule_counts_utf8_bytes_and_ids_exactly_at_the_limit",
        ),
    ),
    Mutant(
        "sizes: a group key over MAX_GROUP_KEY_CHARS is refused",
        "server/rollwire/serving/sizes.py",
        "if len(request.group_key) > MAX_GROUP_KEY_CHARS:",
        "if len(request.group_key) > 2 * MAX_GROUP_KEY_CHARS:",
        ("tests/unit/generator/test_generator_convert.py",),
    ),
    Mutant(
        "admission: a group at most max_staleness versions behind is fresh",
        "learner/rollwire/learner/rollouts/admission.py",
        "fresh = [g for g in groups if staleness(g, version) <= max_staleness]",
        "fresh = [g for g in groups if staleness(g, version) < max_staleness]",
        ("tests/unit/learner/test_learner_admission.py", "tests/unit/learner/test_buffer.py"),
    ),
    Mutant(
        "grpo: advantages are divided by the population std (ddof 0)",
        "learner/rollwire/learner/train/grpo.py",
        "centred = centred / (rewards.std(dim=1, unbiased=False, keepdim=True) + eps)",
        "centred = centred / (rewards.std(dim=1, unbiased=True, keepdim=True) + eps)",
        ("tests/unit/learner/test_grpo.py",),
    ),
    Mutant(
        "grpo: the dual clip bounds a negative advantage's surrogate by ratio_cap x A",
        "learner/rollwire/learner/train/grpo.py",
        "surrogate = torch.where(advantages < 0, torch.max(surrogate, ratio_cap * advantages), surrogate)",
        "surrogate = torch.where(advantages < 0, surrogate, surrogate)",
        ("tests/unit/learner/test_grpo.py",),
    ),
    Mutant(
        "grpo: logprobs are taken under softmax(logits / temperature)",
        "learner/rollwire/learner/train/grpo.py",
        "scaled = logits.float() / temperature",
        "scaled = logits.float()",
        ("tests/unit/learner/test_grpo.py",),
    ),
    Mutant(
        "ingest: a trained token's logprob below ingest.min_logprob is refused",
        "learner/rollwire/learner/ingest/intake.py",
        "if m and not floor <= lp <= 0), None)",
        "if m and not lp <= 0), None)",
        ("tests/unit/learner/test_learner_poison.py::test_the_bounds_are_named_in_the_refusal",),
    ),
    Mutant(
        "trainer: a step whose loss is not finite is never applied",
        "learner/rollwire/learner/train/trainer.py",
        'if not math.isfinite(loss):\n        return "nonfinite_loss"',
        'if False:\n        return "nonfinite_loss"',
        (
            "tests/unit/learner/test_learner_poison.py::test_a_step_with_a_non_finite_gradient_or_loss_is_skipped_counted_and_logged",
        ),
    ),
)


def tree_files() -> list[str]:
    """The checkout's tracked and unignored files (what a clone plus the work in progress holds)."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout
    return [name for name in out.decode().split("\0") if name and (ROOT / name).is_file()]


def copy_tree(into: Path) -> None:
    for name in tree_files():
        target = into / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)


def run_tests(copy: Path, tests: tuple[str, ...], timeout: float) -> tuple[bool, str]:
    """(passed, the tail of pytest's output) for `tests` run in `copy`."""
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    env["PYTHONPATH"] = os.pathsep.join(str(copy / p) for p in ("client", "server", "learner", "tests"))
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:randomly", *tests]
    try:
        done = subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {timeout:g} s (counted as caught)"
    lines = (done.stdout + done.stderr).strip().splitlines()
    return done.returncode == 0, lines[-1] if lines else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("-k", default="", help="only the entries whose name contains this")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for one mutant's tests")
    parser.add_argument("--baseline", action="store_true", help="also run each entry's tests unmutated first")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if args.k in m.name]
    caught, survived, stale = [], [], []
    with tempfile.TemporaryDirectory(prefix="rollwire-mutants-") as tmp:
        copy = Path(tmp)
        copy_tree(copy)
        for m in chosen:
            source = copy / m.path
            text = source.read_text()
            if text.count(m.original) != 1:
                stale.append(m)
                print(f"STALE    {m.name}: the snippet occurs {text.count(m.original)} times in {m.path}")
                continue
            if args.baseline:
                ok, tail = run_tests(copy, m.tests, args.timeout)
                if not ok:
                    stale.append(m)
                    print(f"STALE    {m.name}: its tests fail on the real code ({tail})")
                    continue
            started = time.monotonic()
            source.write_text(text.replace(m.original, m.mutant))
            try:
                passed, tail = run_tests(copy, m.tests, args.timeout)
            finally:
                source.write_text(text)
            seconds = time.monotonic() - started
            (survived if passed else caught).append(m)
            verdict = "MISSED  " if passed else "caught  "
            print(f"{verdict} {m.name}  [{m.path}, {seconds:.1f} s: {tail}]", flush=True)
    print(f"\n{len(caught)} caught, {len(survived)} missed, {len(stale)} stale, of {len(chosen)} mutants")
    for m in survived:
        print(f"missed: {m.name} ({m.path}): no test of {', '.join(m.tests)} failed on the mutant")
    return 1 if survived or stale or not chosen else 0


if __name__ == "__main__":
    raise SystemExit(main())
